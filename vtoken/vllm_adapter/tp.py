"""Tensor parallelism: one eviction decision, every rank compacts its own heads.

With TP every rank holds a slice of the heads of the SAME blocks, so the scheduler's one compaction plan
(``VTokenStep``, broadcast to every worker by vLLM) is correct on every rank as it stands. Two things must
agree across ranks, and this module is where they are made to:

  * the attention statistics: each rank sees only its own heads' attention, so a step's per-(query, key)
    weights are summed over the TP group before they are folded into ``attn_sum`` / ``attn_hist`` (one
    all-reduce of ``4 * rows * max(n_queries) * padded keys`` bytes: the scorer's [R, W, NB * block_size]
    float32 buffer, padded alike on every rank because every rank sees the same metadata); every rank then
    holds the same statistics. It runs only when the scorer observes rows that step (``begin_step``).
  * the application of a plan: after applying a step's moves every rank reports ok / failed to the others
    (an all-gather of one int32 per rank over the group's CPU side). If any rank failed, EVERY rank raises
    the same error, so vLLM's executor sees the output rank fail and the engine stops, instead of ranks
    continuing with divergent KV, or rank 0 waiting forever in the forward's all-reduce for a rank that
    left (vLLM's worker loop logs a non-output rank's exception and carries on).

We use vLLM's own TP group (``vllm.distributed.parallel_state.get_tp_group()``): NCCL (or vLLM's custom
all-reduce) for the device tensor on CUDA, vLLM's CPU communicator (shared memory, or gloo) on CPU, and the
group's gloo ``cpu_group`` for the status flags, which never touch the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


class PlanFailedError(RuntimeError):
    """A tensor-parallel rank could not apply a compaction plan; the engine must stop."""


@dataclass
class ExchangeStats:
    """What the cross-rank exchanges cost on this rank (host time; on CUDA the all-reduce is timed to the
    end of the collective, because the statistics are read right after it)."""

    score_steps: int = 0
    score_bytes: int = 0  # all-reduce payload: 4 bytes per (observed query, padded key) per step
    score_seconds: float = 0.0
    check_steps: int = 0
    check_bytes: int = 0  # status all-gather payload: 4 bytes per rank per step with a plan
    check_seconds: float = 0.0

    def summary(self) -> dict[str, float]:
        per = lambda x, n: x / n if n else 0.0  # noqa: E731
        return {
            **self.__dict__,
            "score_bytes_per_step": per(self.score_bytes, self.score_steps),
            "score_us_per_step": 1e6 * per(self.score_seconds, self.score_steps),
            "check_us_per_step": 1e6 * per(self.check_seconds, self.check_steps),
        }


class TensorParallel:
    """This worker's view of its TP group, for vToken. ``world == 1`` makes every method a no-op.

    Invariant: every rank calls ``sum_scores`` and ``applying`` in the same order with the same arguments'
    shapes, because every rank runs the same steps with the same ``VTokenStep``; that is what keeps the
    collectives matched.
    """

    def __init__(self, group=None) -> None:
        self.group = group
        self.world = group.world_size if group is not None else 1
        self.rank = group.rank_in_group if group is not None else 0
        self.step = 0
        self.stats = ExchangeStats()

    @classmethod
    def current(cls, **kwargs) -> TensorParallel:
        """vLLM's TP group of this worker process (absent outside a vLLM worker: a world of one)."""
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

        group = get_tp_group() if model_parallel_is_initialized() else None
        return cls(group if group is not None and group.world_size > 1 else None, **kwargs)

    @property
    def backend(self) -> str:
        """What carries the device-side all-reduce: nccl on CUDA, gloo under vLLM's CPU communicator."""
        if self.group is None:
            return "none"
        import torch.distributed as dist

        comm = getattr(self.group, "device_communicator", None)
        via = getattr(comm, "dist_module", None)  # vLLM's CPU communicator: shared memory or torch.distributed
        via = "shm" if type(via).__name__ == "_CPUSHMDistributed" else type(comm).__name__
        return f"{dist.get_backend(self.group.device_group)} ({via})"

    def probe(self, numel: int, reps: int = 200) -> dict[str, float]:
        """Latency of each exchange with the ranks already in step (back-to-back collectives, after a
        warm-up): the transfer cost alone, without the wait for a slower rank that a step's timing includes.
        Every rank must call it with the same arguments. Counts nothing in ``stats``."""
        if self.world == 1:
            return {"score_us": 0.0, "check_us": 0.0, "score_bytes": 0}
        w = torch.zeros(numel, dtype=torch.float32, device=self.group.device)
        saved, self.stats = self.stats, ExchangeStats()
        try:
            for _ in range(10):
                self.sum_scores(w)
            t0 = time.perf_counter()
            for _ in range(reps):
                self.sum_scores(w)
            score = (time.perf_counter() - t0) / reps
            self._gather_status(False)
            t0 = time.perf_counter()
            for _ in range(reps):
                self._gather_status(False)
            check = (time.perf_counter() - t0) / reps
        finally:
            self.stats = saved
        return {"score_us": 1e6 * score, "check_us": 1e6 * check, "score_bytes": 4 * numel}

    # ------------------------------------------------------------ attention statistics
    def sum_scores(self, w: torch.Tensor) -> torch.Tensor:
        """This step's attention weights per (observed query, key), this rank's heads -> all heads."""
        if self.world == 1:
            return w
        t0 = time.perf_counter()
        out = self.group.all_reduce(w.contiguous())
        if out.is_cuda:
            torch.cuda.current_stream().synchronize()
        self.stats.score_seconds += time.perf_counter() - t0
        self.stats.score_steps += 1
        self.stats.score_bytes += w.numel() * w.element_size()
        return out

    # ------------------------------------------------------------ plan application
    @contextlib.contextmanager
    def applying(self, step) -> Iterator[None]:
        """Wrap the application of one ``VTokenStep``: if any rank raises inside, every rank raises
        ``PlanFailedError`` naming the failed rank(s), the step and its requests."""
        self.step += 1
        has_plan = bool(len(step.moves) or step.keep_blocks)
        if self.world == 1 or not has_plan:
            yield
            return
        error: BaseException | None = None
        try:
            yield
        except Exception as e:  # reported to every rank below, then raised everywhere
            error = e
        if not self._gather_status(error is not None):
            return
        import torch.distributed as dist

        # Failure path only: every rank learns every rank's error, so the output rank's message names it.
        errors: list = [None] * self.world
        dist.all_gather_object(
            errors, None if error is None else f"{type(error).__name__}: {error}", group=self.group.cpu_group
        )
        why = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        reqs = sorted(step.keep_blocks)
        raise PlanFailedError(
            f"vToken: tensor-parallel rank(s) {[r for r, e in enumerate(errors) if e]} failed to apply the "
            f"compaction plan of step {self.step} ({len(step.moves)} moves, requests {reqs}) ({why}). "
            "Stopping the engine rather than serving divergent KV caches."
        ) from error

    def _gather_status(self, failed: bool) -> list[int]:
        import torch.distributed as dist

        t0 = time.perf_counter()
        mine = torch.tensor([int(failed)], dtype=torch.int32)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group.cpu_group)
        self.stats.check_seconds += time.perf_counter() - t0
        self.stats.check_steps += 1
        self.stats.check_bytes += 4 * self.world
        return [r for r, t in enumerate(every) if int(t)]
