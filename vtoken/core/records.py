"""What vToken records, per request and per engine. Plain Python and NumPy; the compactor fills it.

Per request: the forwards it ran (prefill chunks and decode steps, counted together from 0), the tokens it
evicted and at which forward, the blocks it held during each forward against the bound its budget allows,
the time-averaged blocks over decode steps (retained, Naive-Evict's, the floor), and tokens moved.
Per engine: counters since start (tokens evicted and moved, blocks freed, compaction time, preemptions).

Blocks are counted DURING a forward, after vLLM allocated the blocks its new tokens go to:
  retained  what the request holds (naive mode: with the ballast that models Naive-Evict)
  naive     every block with a live token at its original position, plus the blocks of the new tokens
  floor     ceil((live + new) / block_size)
  bound     ceil((keep + new) / block_size) + 1, keep = what the budget allows at the current length
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vtoken.core.token_table import TokenTable


def request_seed(request_id: str) -> int:
    """A stable number per request id (Python's hash() is salted per process): randomised policies seed from the
    caller's id, so that reruns, naive and vtoken, and every TP rank reach the same decisions."""
    return zlib.crc32(request_id.encode())


@dataclass
class RequestRecord:
    request_id: str  # the caller's id (never vLLM's internal one)
    seed: int
    policy: str = ""
    budget: float = 0.0
    prefix_cached: int = 0  # prompt tokens read from the prefix cache (no forward of this request computed them)
    outputs_at_start: int = 0  # outputs sampled before this run (a preempted request recomputes them first)
    earlier: list[dict[str, Any]] = field(default_factory=list)  # trace() of the runs a preemption ended
    forwards: int = 0  # forwards run so far; the next forward's index
    prefill_chunks: list[int] = field(default_factory=list)  # sizes of the prefill forwards, in order
    died_pos: list[np.ndarray] = field(default_factory=list)
    died_step: list[np.ndarray] = field(default_factory=list)
    died_forward: list[np.ndarray] = field(default_factory=list)
    restored_pos: list[np.ndarray] = field(default_factory=list)  # parked, then back in the pool (vtoken/core/park.py)
    restored_parked_at: list[np.ndarray] = field(default_factory=list)  # the first forward that did not see them
    restored_at: list[np.ndarray] = field(default_factory=list)  # the first forward that saw them again
    shed_at: int = -1  # pressure mode: the forward before which it shed first (-1: never)
    shed_tokens: int = 0  # pressure mode: tokens it gave up at sheds (parked, or lost when the tier had no room)
    joint_forward: int = -1  # parking: the last chunk's forward, which attended the parked tokens too (-1: none)
    joint_positions: np.ndarray | None = None  # the parked tokens that forward attended
    tokens_moved: int = 0
    steps: int = 0  # decode forwards
    sum_retained: int = 0
    sum_naive: int = 0
    sum_floor: int = 0
    peak_retained: int = 0  # over every forward, prefill chunks included
    peak_naive: int = 0
    over_bound: int = -(1 << 30)  # max over forwards of retained - bound (<= 0: the bound held)
    forward_blocks: list[int] = field(default_factory=list)  # retained blocks during each forward
    logprobs: list[float] | None = None  # the sampled tokens' log-probabilities, when the request asked
    final: dict[str, Any] | None = None

    def record_deaths(
        self, logical: np.ndarray, step: int, at_forward: np.ndarray | None = None, at_step: np.ndarray | None = None
    ) -> None:
        """``logical`` died before forward ``self.forwards`` (decode step ``step``; 0 during the prefill), or before
        ``at_forward`` (parked tokens freed for good: the forward that parked them, at decode step ``at_step``)."""
        n = len(logical)
        self.died_pos.append(np.asarray(logical, dtype=np.int64))
        self.died_step.append(np.full(n, step, dtype=np.int64) if at_step is None else np.asarray(at_step, np.int64))
        at = np.full(n, self.forwards, dtype=np.int64) if at_forward is None else np.asarray(at_forward, np.int64)
        self.died_forward.append(at)

    def record_restored(self, logical: np.ndarray, parked_at: np.ndarray) -> None:
        """Parked ``logical`` tokens come back: forwards ``parked_at`` .. ``self.forwards - 1`` did not see them."""
        self.restored_pos.append(np.asarray(logical, dtype=np.int64))
        self.restored_parked_at.append(np.asarray(parked_at, dtype=np.int64))
        self.restored_at.append(np.full(len(logical), self.forwards, dtype=np.int64))

    def saw_parked(self, logical: np.ndarray) -> None:
        """The forward just recorded (``self.forwards - 1``) attends these parked tokens besides the live ones."""
        self.joint_forward = self.forwards - 1
        self.joint_positions = np.asarray(logical, dtype=np.int64).copy()

    def forward(self, new_tokens: int, prefill: bool, retained: int, naive: int, floor: int, bound: int) -> None:
        """A forward of ``new_tokens`` tokens runs now, with the request holding ``retained`` blocks."""
        self.forwards += 1
        if prefill:
            self.prefill_chunks.append(int(new_tokens))
        else:
            self.steps += 1
            self.sum_retained += retained
            self.sum_naive += naive
            self.sum_floor += floor
        self.forward_blocks.append(int(retained))
        self.peak_retained = max(self.peak_retained, retained)
        self.peak_naive = max(self.peak_naive, naive)
        self.over_bound = max(self.over_bound, retained - bound)

    def snapshot(self, table: TokenTable, n_blocks: int, n_ballast: int) -> dict[str, Any]:
        mean = lambda total: total / self.steps if self.steps else float(n_blocks)  # noqa: E731
        return {
            "logical_tokens": table.num_logical,
            "live_tokens": table.num_live,
            "retained_blocks": n_blocks + n_ballast,
            "naive_retained_blocks": table.naive_blocks(),
            "floor_blocks": -(-table.num_live // table.block_size),
            "tokens_moved": self.tokens_moved,
            "mean_retained_blocks": mean(self.sum_retained),
            "mean_naive_retained_blocks": mean(self.sum_naive),
            "mean_floor_blocks": mean(self.sum_floor),
            "decode_steps": self.steps,
            "forwards": self.forwards,
            "policy": self.policy,
            "budget": self.budget,
            "peak_retained_blocks": self.peak_retained,
            "peak_naive_retained_blocks": self.peak_naive,
            "peak_over_bound": self.over_bound if self.forwards else 0,
            "metadata_bytes": table.nbytes,
        }

    def finish(self, table: TokenTable, n_blocks: int, n_ballast: int) -> None:
        self.final = self.snapshot(table, n_blocks, n_ballast)

    def trace(self) -> dict[str, Any]:
        """The audit fields of a trace line: with the prompt and output ids, enough to rebuild which query saw
        which key (tests/reference.py does)."""
        cat = lambda parts: np.concatenate(parts).tolist() if parts else []  # noqa: E731
        out = {
            "outputs_at_start": self.outputs_at_start,
            "evicted_positions": cat(self.died_pos),
            "evicted_at_step": cat(self.died_step),
            "evicted_at_forward": cat(self.died_forward),
            "prefill_chunks": list(self.prefill_chunks),
            "prefix_cached_tokens": self.prefix_cached,
            "blocks_per_forward": list(self.forward_blocks),
        }
        if self.restored_pos:  # hidden from forward parked_at_forward up to restored_at_forward (excluded)
            out["restored_positions"] = cat(self.restored_pos)
            out["parked_at_forward"] = cat(self.restored_parked_at)
            out["restored_at_forward"] = cat(self.restored_at)
        if self.joint_forward >= 0:  # that forward saw these parked tokens as well as the live ones
            out["joint_forward"] = self.joint_forward
            out["joint_positions"] = self.joint_positions.tolist()
        if self.shed_at >= 0:
            out["shed_at_forward"] = self.shed_at
            out["shed_tokens"] = self.shed_tokens
        if self.earlier:
            out["preempted_runs"] = list(self.earlier)
        if self.logprobs is not None:
            out["logprobs"] = list(self.logprobs)
        return out


@dataclass
class EngineTotals:
    """Counters since the engine started (``*_seconds``: host time)."""

    compaction_seconds: float = 0.0
    move_seconds: float = 0.0
    score_seconds: float = 0.0  # the worker's scoring (attention statistics), host time
    bytes_moved: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    tokens_parked: int = 0  # tokens sent to the tier (restored or freed later)
    tokens_restored: int = 0  # parked tokens back in the pool (a choice with the question, a recall, re-inflation)
    tokens_recalled: int = 0  # of those, brought back by a recall while decoding
    tokens_reinflated: int = 0  # of those, brought back because the pool had room again
    tokens_dropped_full: int = 0  # parked tokens freed for good because the tier was full (the oldest first)
    recalls: int = 0  # choices among live and parked tokens while decoding
    recall_bytes: int = 0  # parked bytes the worker read to score recalls (boxes and candidates' keys)
    recall_seconds: float = 0.0  # the worker's host time scoring recalls (part of score_seconds)
    blocks_freed: int = 0
    preemptions: int = 0
    preemptions_in_prefill: int = 0
    peak_running: int = 0  # most requests running at once since the last reset (vtoken_stats(reset=True))
    finished: list[dict[str, Any]] = field(default_factory=list)
    keep_finished: int = 1000  # a long-running server keeps the last this many finished records

    def note_step(self, running: int, seconds: float) -> None:
        """The engine's step: how many requests ran, and the host time spent planning and recording."""
        self.peak_running = max(self.peak_running, running)
        self.compaction_seconds += seconds

    def note_worker(
        self,
        move_seconds: float,
        bytes_moved: int,
        tokens_moved: int = 0,
        score_seconds: float = 0.0,
        recall_bytes: int = 0,
        recall_seconds: float = 0.0,
    ) -> None:
        """The worker's side of a step (and moves made outside the compactor's plans, e.g. testing relocation)."""
        self.recall_bytes += recall_bytes
        self.recall_seconds += recall_seconds
        self.score_seconds += score_seconds
        self.move_seconds += move_seconds
        self.bytes_moved += bytes_moved
        self.tokens_moved += tokens_moved

    def add_finished(self, record: RequestRecord) -> None:
        self.finished.append({"request_id": record.request_id, **(record.final or {})})
        del self.finished[: -self.keep_finished]

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
            "score_seconds": self.score_seconds,
            "bytes_moved": self.bytes_moved,
            "tokens_moved": self.tokens_moved,
            "tokens_evicted": self.tokens_evicted,
            "tokens_parked": self.tokens_parked,
            "tokens_restored": self.tokens_restored,
            "tokens_recalled": self.tokens_recalled,
            "tokens_reinflated": self.tokens_reinflated,
            "tokens_dropped_full": self.tokens_dropped_full,
            "recalls": self.recalls,
            "recall_bytes": self.recall_bytes,
            "recall_seconds": self.recall_seconds,
            "blocks_freed": self.blocks_freed,
            "preemptions_seen": self.preemptions,
            "preemptions_in_prefill": self.preemptions_in_prefill,
            "peak_running": self.peak_running,
            "fragmentation": 1 - live / (retained * block_size) if retained else 0.0,
            "finished_requests": list(self.finished),
        }


class TraceBook:
    """The audit trail's bookkeeping across preemptions: a preempted request recomputes from token 0 as a new run,
    and its trace line carries the runs a preemption ended (``preempted_runs``) and the log-probabilities sampled
    so far. Kept by the compactor, so that the engine's scheduler and the property tests drive the same code."""

    def __init__(self) -> None:
        # engine request id -> (caller's id, traces of its earlier runs, logprobs so far)
        self._resume: dict[str, tuple[str, list[dict[str, Any]], list[float] | None]] = {}

    def resume(self, request_id: str) -> tuple[list[dict[str, Any]], list[float] | None]:
        """A request admitted again after a preemption: its earlier runs and logprobs (empty for a new one)."""
        _, earlier, logprobs = self._resume.pop(request_id, ("", [], None))
        return earlier, logprobs

    def preempted(self, request_id: str, record: RequestRecord) -> None:
        """The run of ``record`` ended by a preemption: kept for the request's next run."""
        run = {k: v for k, v in record.trace().items() if k not in ("preempted_runs", "logprobs")}
        self._resume[request_id] = (record.request_id, record.earlier + [run], record.logprobs)

    def ended(
        self,
        request_id: str,
        record: RequestRecord | None,
        finished: bool,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
    ) -> dict[str, Any] | None:
        """A run ended: a preempted one is kept for the next run (None); a finished request's trace line is
        returned (None when it never ran). ``record``: the run's (None: it ended while waiting to resume)."""
        if not finished:
            if record is not None:
                self.preempted(request_id, record)
            return None
        line = self.finished(request_id, record)
        if line is None:
            return None
        caller, fields = line
        return {"request_id": caller, "prompt_token_ids": list(prompt_ids), "output_token_ids": list(output_ids),
                **fields}  # fmt: skip

    def finished(self, request_id: str, record: RequestRecord | None) -> tuple[str, dict[str, Any]] | None:
        """The caller's id and the audit fields of a finished request's trace line; ``record`` None: it finished
        (was aborted) while waiting to resume after a preemption (its last run's fields, None if it never ran)."""
        pending = self._resume.pop(request_id, None)
        if record is not None:
            return record.request_id, record.trace()
        if pending is None:
            return None
        caller, runs, logprobs = pending
        return caller, {**runs[-1], "preempted_runs": runs[:-1], **({"logprobs": logprobs} if logprobs else {})}
