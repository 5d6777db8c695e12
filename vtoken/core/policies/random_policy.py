"""Random eviction: the paper's control policy; deterministic per (seed, request, step)."""

import numpy as np

from vtoken.core.policies.base import EvictionPolicy, PolicyInput
from vtoken.core.policies.registry import register


@register("random")
class Random(EvictionPolicy):
    """Uniform scores from a generator keyed by (seed, request, step): reruns and ranks agree."""

    def score(self, inp: PolicyInput):
        rng = np.random.default_rng([self.seed, inp.request_seed, inp.step])
        return rng.random(len(inp.live))
