"""Autoscaler: the replica count from demand and from the capacity vToken reclaims.

    effective free  = sum(free - promised)                    over live replicas
    scale out       : effective free < low_watermark * all blocks, or requests waiting,  for sustain_s
    scale in        : effective free - one replica's blocks
                      >= scale_in_margin * one replica's blocks, and nothing waiting,    for sustain_s
    never two decisions within cooldown_s; always within [min_replicas, limit]

Blocks vToken reclaims (naive-retained minus retained) are already back in a replica's ``free_blocks``, so
they are not added again: they are named in the reason only, as the part of the spare capacity vToken made.
The gap between the two thresholds plus ``sustain_s`` is the hysteresis: a cluster just scaled out has
at most one replica's worth spare, which is under the scale-in threshold. ``decide`` is pure apart
from its timers, so tests drive it with scripted reports and a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cluster.config import AutoscalingConfig
from cluster.placement.strategies import ReplicaView


class Decision(NamedTuple):
    time: float
    from_replicas: int
    to_replicas: int
    reason: str


@dataclass
class Autoscaler:
    cfg: AutoscalingConfig
    out_since: float | None = None
    in_since: float | None = None
    last_decision: float = float("-inf")

    def decide(
        self, now: float, replicas: list[ReplicaView], current: int, limit: int | None = None
    ) -> Decision | None:
        """``replicas``: the live ones with reports; ``current``: the target count now; ``limit``: the most
        replicas the machine or cluster can hold (None: max_replicas)."""
        hi = min(self.cfg.max_replicas, limit if limit is not None else self.cfg.max_replicas)
        if not replicas:
            self.out_since = self.in_since = None
            return None
        total = sum(r.total_blocks for r in replicas)
        per_replica = total / len(replicas)
        eff_free = sum(r.effective_free for r in replicas)
        waiting = sum(r.waiting for r in replicas)
        reclaimed = sum(r.blocks_reclaimed for r in replicas)  # part of eff_free already: explanation only

        want_out = eff_free < self.cfg.low_watermark * total or waiting > 0
        want_in = not want_out and eff_free - per_replica >= self.cfg.scale_in_margin * per_replica
        self.out_since = (self.out_since if self.out_since is not None else now) if want_out else None
        self.in_since = (self.in_since if self.in_since is not None else now) if want_in else None
        if now - self.last_decision < self.cfg.cooldown_s:
            return None
        if want_out and now - self.out_since >= self.cfg.sustain_s and current < hi:
            why = (
                f"{waiting} waiting" if waiting else ""
            ) or f"effective free {eff_free}/{total} blocks < low watermark {self.cfg.low_watermark:.0%}"
            return self._decided(now, current, current + 1, f"scale out: {why} for {now - self.out_since:.0f}s")
        if want_in and now - self.in_since >= self.cfg.sustain_s and current > self.cfg.min_replicas:
            return self._decided(
                now,
                current,
                current - 1,
                f"scale in: effective free {eff_free} blocks ({reclaimed} of them reclaimed by "
                f"vToken) exceeds one replica ({per_replica:.0f}) by {self.cfg.scale_in_margin:.0%} "
                f"for {now - self.in_since:.0f}s",
            )
        if current > hi:
            return self._decided(now, current, hi, f"scale in: over the limit of {hi} replicas")
        return None

    def _decided(self, now: float, frm: int, to: int, reason: str) -> Decision:
        self.last_decision, self.out_since, self.in_since = now, None, None
        return Decision(now, frm, to, reason)


def request_cluster_resources(num_replicas: int, num_cpus: float, num_gpus: float) -> None:
    """Ask Ray's autoscaler to keep room for ``num_replicas`` replicas (it adds nodes as needed)."""
    from ray.autoscaler.sdk import request_resources

    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    request_resources(bundles=[bundle] * num_replicas)
