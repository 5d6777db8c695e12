"""Placements only the simulator can run, to judge the real ones against: they know what no controller knows.

``prefix_oracle`` sees every replica's prefix cache as it is at the moment of placement (``exact_prefix``: the fleet
reads the simulated caches, not the controller's index of them) and sends each request to the longest hit, under
the same balance guard as ``prefix`` (cluster/placement/strategies.py); without a hit worth it, or past the guard, it
places as ``weighted`` does. Its hit rate is what prefix-aware placement could reach on a workload with that guard.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.placement.strategies import PlacementStrategy, Prefix


class PrefixOracle(Prefix):
    exact_prefix = True

    def choose(self, replicas, need_blocks):
        score = self.weighted.scores(replicas)

        def rank(r, by_hit: bool) -> tuple:
            hit = r.prefix_blocks if by_hit else 0
            return r.effective_free >= need_blocks, not r.stale, hit, score[r.name], r.name

        fallback = max(replicas, key=lambda r: rank(r, False))
        best = max(replicas, key=lambda r: rank(r, True))
        if best is fallback or best.prefix_share < self.min_share or self.overloaded(best, replicas, need_blocks):
            return fallback
        return best


SIM_STRATEGIES: dict[str, Callable[[], PlacementStrategy]] = {"prefix_oracle": PrefixOracle}
