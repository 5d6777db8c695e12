"""The small picklable types that cross between vToken's scheduler and its workers each step.

They ride on vLLM's own per-step objects as an extra attribute (``SchedulerOutput.vtoken``,
``ModelRunnerOutput.vtoken``), which survive vLLM's pickling between the EngineCore and worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vtoken.mover import MoveBatch


@dataclass
class VTokenStep:
    """Scheduler -> worker, once per step, applied before that step's forward."""

    moves: MoveBatch  # global slots, all requests, one batch
    keep_blocks: dict[str, int] = field(default_factory=dict)  # req -> blocks it keeps (tail was freed)
    gaps: dict[str, int] = field(default_factory=dict)  # req -> logical - physical length (changes only)
    observe: dict[str, int] = field(default_factory=dict)  # req -> how many of this forward's last queries to score
    export: dict[str, tuple[str, ...]] = field(default_factory=dict)  # req -> statistics to send back after it


@dataclass
class VTokenWorkerOutput:
    """Worker -> scheduler, after the forward: attention statistics per physical slot of each request."""

    stats: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # req -> name -> [physical_len]
    move_seconds: float = 0.0
    bytes_moved: int = 0


def empty_step() -> VTokenStep:
    return VTokenStep(MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64)))


class PoolReport(NamedTuple):
    """EngineCore -> its client (a replica, a metrics exporter): the engine's KV pool in a few numbers.

    Cheap by construction: O(running requests) small integer sums, no per-token work, no request records.
    Counters (``*_total``) only grow for the engine's life; the rest describe this moment.
    """

    free_blocks: int  # blocks vLLM's pool can hand out now
    total_blocks: int  # usable blocks in the pool (vLLM's null block excluded)
    kv_cache_usage: float  # vLLM's own figure: 1 - free / total
    running: int
    waiting: int
    live_tokens: int  # live tokens over running requests
    retained_blocks: int  # blocks running requests hold (naive mode: with its ballast)
    naive_retained_blocks: int  # blocks Naive-Evict would hold for the same live tokens
    blocks_reclaimed: int  # naive_retained_blocks - retained_blocks, never below 0
    admitted: tuple[str, ...]  # caller ids of the requests whose blocks these figures count, sorted
    blocks_freed_total: int  # blocks returned to the pool by compaction
    tokens_evicted_total: int
    tokens_moved_total: int
    compaction_seconds_total: float  # scheduler-side eviction + planning time
    preemptions_total: int

    block_size: int

    @classmethod
    def from_wire(cls, fields) -> PoolReport:
        """vLLM's utility RPC carries a NamedTuple as a plain sequence (msgpack, tuples become lists)."""
        r = cls._make(fields)
        return r._replace(admitted=tuple(r.admitted))

    @property
    def fragmentation(self) -> float:
        """Share of the retained blocks' slots that hold no live token."""
        cap = self.retained_blocks * self.block_size
        return 0.0 if not cap else max(0.0, 1.0 - self.live_tokens / cap)
