"""The byte order of one engine step on the worker: the one place that says in which order a step's KV bytes move.
No vLLM; the runner (vtoken/vllm_adapter/model_runner.py) and the tests call the same function.

    1. fetch    the tokens this step restores, copied out of the tier   (a tier slot may be re-used by 2.)
    2. park     pool slots -> tier slots                               (read before 3. packs over them)
    3. move     the step's compaction moves, one gather-then-scatter    (the mover; may run on a side stream)
    4. restore  the fetched tokens -> pool slots                       (slots that 3. emptied: after its moves)

Why this order: the scheduler plans a step's parking, packing and restoring against the slots as they stand
before the step (vtoken/core/compactor.py), so every source must be read before any destination is written. A parked
token leaves a hole the packing then fills; a restored token lands in a slot the packing emptied; and a tier slot
one request leaves may be taken by another request's parking in the same step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.mover import Mover


class StepCost(NamedTuple):
    move_seconds: float  # host time spent issuing the compaction moves
    bytes_moved: int  # the compaction moves' bytes (the tier counts its own)


def apply_kv_step(
    mover: Mover,
    tier,
    kv_caches: Sequence[torch.Tensor],
    extra: Sequence[torch.Tensor],
    moves: MoveBatch,
    park: MoveBatch,
    restore: MoveBatch,
) -> StepCost:
    """Apply one step's parking, moves and restoring to ``kv_caches`` and the per-slot ``extra`` tensors, in the
    order above. ``tier``: a ``vtoken.kv.tier.KVTier``, or None without parking (``park`` and ``restore`` are then
    empty). On CUDA the moves may still run on the mover's stream when this returns; the caller orders the
    forward after them (``Mover.wait`` / ``wait_unhooked``)."""
    fetched = None
    if tier is not None:
        fetched = tier.fetch(restore)
        tier.park(kv_caches, extra, park)
    seconds, nbytes = 0.0, 0
    if len(moves):
        t0, before = time.perf_counter(), mover.bytes_moved
        mover.apply(kv_caches, moves, extra)
        seconds, nbytes = time.perf_counter() - t0, mover.bytes_moved - before
    if tier is not None and len(restore):
        mover.wait()  # the restore runs on the current stream and writes slots the moves emptied
        tier.restore(kv_caches, extra, restore, fetched)
    return StepCost(seconds, nbytes)
