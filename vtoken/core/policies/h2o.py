"""H2O (Zhang et al., 2023): keep the heavy hitters, the tokens with the most accumulated attention."""

from vtoken.core.policies.base import ATTN_SUM, EvictionPolicy, PolicyInput
from vtoken.core.policies.registry import register


@register("h2o")
class H2O(EvictionPolicy):
    """Score = attention each token has received so far, summed over decode steps, heads and layers.

    The recent window of the base class plays the role of H2O's local (recent) cache.
    """

    needs = (ATTN_SUM,)

    def score(self, inp: PolicyInput):
        return inp.stats[ATTN_SUM]
