"""SnapKV (Li et al., 2024): the observation window's attention, max-pooled over neighbouring tokens."""

import numpy as np

from vtoken.core.policies.base import ATTN_SUM, EvictionPolicy, PolicyInput, param
from vtoken.core.policies.registry import register


@register("snapkv")
class SnapKV(EvictionPolicy):
    """Score = the most attention (as h2o counts it) received by any token from ``before`` tokens before it to
    ``after`` tokens after it, in logical order: a fact's tokens are kept together (SnapKV's clustering). SnapKV
    pools symmetrically; a question attends to a fact's key and its value follows the key, so the window looks
    further back (docs/design.md: Why these defaults)."""

    before: int = param(12, ge=0, le=4096)
    after: int = param(2, ge=0, le=4096)
    needs = (ATTN_SUM,)
    window_scores = True  # while decoding: the window of recent queries, scored once before a decision

    def score(self, inp: PolicyInput):
        x, b, a = np.asarray(inp.stats[ATTN_SUM], dtype=np.float64), self.before, self.after
        padded = np.pad(x, (b, a), constant_values=-np.inf)
        return np.lib.stride_tricks.sliding_window_view(padded, b + a + 1).max(axis=-1)
