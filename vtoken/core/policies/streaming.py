"""StreamingLLM (Xiao et al., 2024): attention sinks plus a recent window."""

import numpy as np

from vtoken.core.policies.base import EvictionPolicy, PolicyInput
from vtoken.core.policies.registry import register


@register("streaming")
class Streaming(EvictionPolicy):
    """Newer tokens score higher, so what survives is the sinks plus the most recent ``budget`` tokens."""

    def score(self, inp: PolicyInput):
        return np.asarray(inp.live, dtype=np.float64)
