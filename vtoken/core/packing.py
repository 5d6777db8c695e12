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


def protected_blocks(blocks: list) -> int:
    """Blocks at the head of a request's list (``blocks``: objects with ``ref_cnt``) that are never evicted from or
    moved: every block up to the last one another request also holds (ref_cnt > 1, e.g. a cached prefix). Shared
    blocks are a prefix in the usual case; after a cache entry was dropped mid-prefix, vLLM can hand a later
    request a mix of copies, and a private block between two shared ones is then kept whole too (the planner moves
    nothing below the protected length)."""
    shared = np.flatnonzero([b.ref_cnt > 1 for b in blocks])
    return int(shared[-1]) + 1 if shared.size else 0


def protected_tokens(table: TokenTable, live: np.ndarray, blocks: list, block_size: int) -> np.ndarray | None:
    """Which of the ``live`` tokens sit in protected blocks (``protected_blocks``) and are never evicted (the
    paper's rule for shared blocks); None when no block is protected."""
    n = protected_blocks(blocks)
    if not n:
        return None
    return table.slot_of[live] < n * block_size
