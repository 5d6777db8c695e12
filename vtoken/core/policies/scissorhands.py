"""Scissorhands (Liu et al., 2023): persistence of importance over a history window."""

from dataclasses import dataclass

import numpy as np

from vtoken.core.policies.base import ATTN_HIST, EvictionPolicy, PolicyInput, param
from vtoken.core.policies.registry import register


@register("scissorhands")
@dataclass(frozen=True)
class Scissorhands(EvictionPolicy):
    """Score = in how many of the last ``history`` decode steps the token was important (attention above
    the uniform share). Tokens that were pivotal before tend to stay pivotal, so the least persistent go. The
    register holds 64 steps (ATTN_HIST), so ``history`` is 1 to 64."""

    history: int = param(32, ge=1, le=64)
    needs = (ATTN_HIST,)

    def score(self, inp: PolicyInput):
        window = np.int64((1 << min(self.history, 63)) - 1)
        return np.bitwise_count(inp.stats[ATTN_HIST].astype(np.int64) & window)
