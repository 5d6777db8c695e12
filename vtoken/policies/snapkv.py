"""SnapKV (Li et al., 2024): the observation window's attention, max-pooled over neighbouring tokens."""

import numpy as np

from vtoken.policies.base import ATTN_SUM, EvictionPolicy, PolicyInput
from vtoken.policies.registry import register


@register("snapkv")
class SnapKV(EvictionPolicy):
    """Score = the attention a token received (as h2o), max-pooled over the ``kernel`` tokens around it in
    logical order: a fact's tokens are kept together, not its one most-attended token (SnapKV's clustering)."""

    kernel: int = 7
    needs = (ATTN_SUM,)

    def score(self, inp: PolicyInput):
        x, half = np.asarray(inp.stats[ATTN_SUM], dtype=np.float64), max(self.kernel, 1) // 2
        padded = np.pad(x, half, constant_values=-np.inf)
        return np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1).max(axis=-1)
