"""The kill, plan and apply of one request's eviction: the one way a request's tokens die and its survivors pack.
Plain NumPy; the compactor, replay and the scorer's tests all pack through here."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vtoken.core.move_batch import MoveBatch
from vtoken.core.planner import CompactionPlan, plan_compaction, to_global_slots
from vtoken.core.token_table import TokenTable


class Packed(NamedTuple):
    """``kill_and_pack``'s result: the moves in global slots, what the victims vacated, the plan it applied."""

    moves: MoveBatch
    holes: np.ndarray  # request-local slots the victims left
    plan: CompactionPlan


def kill_and_pack(
    table: TokenTable, victims: np.ndarray, block_ids: list[int], block_size: int, protected_blocks: int = 0
) -> Packed:
    """THE kill, plan and apply of one request: the victims die, the planner packs the survivors below the
    protected blocks, the table records the moves. The caller applies ``moves`` to the KV (one gather-then-
    scatter for the whole step) and keeps ``block_ids[:plan.keep_blocks]``. The compactor, replay and the
    scorer's tests all pack through here."""
    holes = table.kill(victims)
    plan = plan_compaction(table.physical_live_mask(), block_ids, block_size, protected_blocks)
    table.apply_moves(plan.src, plan.dst, plan.physical_len)
    moves = MoveBatch(
        to_global_slots(plan.src, block_ids, block_size), to_global_slots(plan.dst, block_ids, block_size)
    )
    return Packed(moves, holes, plan)
