"""What vToken reports, per request and per engine.

Per request: logical tokens, live tokens, retained blocks (what the request holds in the pool; in naive
mode this includes the ballast that models Naive-Evict), naive-retained blocks (blocks with a live token at
its original position, plus the block being filled), tokens moved, and the time-averaged and peak blocks.
Per engine: blocks reclaimed (naive-retained minus retained, over running requests), compaction time,
bytes moved, fragmentation 1 - live / (retained * block_size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vtoken.accounting import naive_retained_blocks
from vtoken.token_table import TokenTable


@dataclass
class RequestRecord:
    request_id: str
    seed: int
    died_pos: list[np.ndarray] = field(default_factory=list)
    died_step: list[np.ndarray] = field(default_factory=list)
    tokens_moved: int = 0
    steps: int = 0
    sum_retained: int = 0
    sum_naive: int = 0
    sum_floor: int = 0
    policy: str = ""
    budget: float = 0.0
    peak_retained: int = 0
    peak_naive: int = 0
    final: dict[str, Any] | None = None

    def record_deaths(self, logical: np.ndarray, step: int) -> None:
        self.died_pos.append(np.asarray(logical, dtype=np.int64))
        self.died_step.append(np.full(len(logical), step, dtype=np.int64))

    def observe(self, retained: int, naive: int, floor: int) -> None:
        self.steps += 1
        self.sum_retained += retained
        self.sum_naive += naive
        self.sum_floor += floor
        self.peak_retained = max(self.peak_retained, retained)
        self.peak_naive = max(self.peak_naive, naive)

    def snapshot(self, table: TokenTable, n_blocks: int, n_ballast: int) -> dict[str, Any]:
        return {
            "logical_tokens": table.num_logical,
            "live_tokens": table.num_live,
            "retained_blocks": n_blocks + n_ballast,
            "naive_retained_blocks": naive_retained_blocks(table.live_mask(), table.block_size),
            "floor_blocks": -(-table.num_live // table.block_size),
            "tokens_moved": self.tokens_moved,
            "mean_retained_blocks": self.sum_retained / self.steps if self.steps else float(n_blocks),
            "mean_naive_retained_blocks": self.sum_naive / self.steps if self.steps else float(n_blocks),
            "mean_floor_blocks": self.sum_floor / self.steps if self.steps else float(n_blocks),
            "decode_steps": self.steps,
            "policy": self.policy,
            "budget": self.budget,
            "peak_retained_blocks": self.peak_retained,
            "peak_naive_retained_blocks": self.peak_naive,
            "metadata_bytes": table.nbytes,
        }

    def finish(self, table: TokenTable, blocks: list, n_ballast: int) -> None:
        self.final = self.snapshot(table, len(blocks), n_ballast)

    def trace(self) -> dict[str, Any]:
        pos = np.concatenate(self.died_pos) if self.died_pos else np.empty(0, np.int64)
        step = np.concatenate(self.died_step) if self.died_step else np.empty(0, np.int64)
        return {"evicted_positions": pos.tolist(), "evicted_at_step": step.tolist()}


@dataclass
class EngineTotals:
    compaction_seconds: float = 0.0
    move_seconds: float = 0.0
    bytes_moved: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    preemptions: int = 0
    peak_running: int = 0  # most requests running at once since the last reset (vtoken_stats(reset=True))
    finished: list[dict[str, Any]] = field(default_factory=list)

    def add_finished(self, record: RequestRecord) -> None:
        self.finished.append({"request_id": record.request_id, **(record.final or {})})
        del self.finished[:-1000]  # bounded: a long-running server keeps the last 1000

    def summary(self, running: dict[str, dict[str, Any]], block_size: int) -> dict[str, Any]:
        retained = sum(r["retained_blocks"] for r in running.values())
        naive = sum(r["naive_retained_blocks"] for r in running.values())
        live = sum(r["live_tokens"] for r in running.values())
        return {
            "blocks_reclaimed": max(naive - retained, 0),
            "retained_blocks": retained,
            "naive_retained_blocks": naive,
            "live_tokens": live,
            "compaction_seconds": self.compaction_seconds,
            "move_seconds": self.move_seconds,
            "bytes_moved": self.bytes_moved,
            "tokens_moved": self.tokens_moved,
            "blocks_freed": self.blocks_freed,
            "preemptions_seen": self.preemptions,
            "peak_running": self.peak_running,
            "fragmentation": 1 - live / (retained * block_size) if retained else 0.0,
            "finished_requests": list(self.finished),
        }
