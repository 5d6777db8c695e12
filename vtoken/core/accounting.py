"""Block accounting: what a request holds under vToken, under Naive-Evict, and the floor.

Naive-Evict is the paper's paired baseline: the same eviction decisions, but no token ever moves, so a
block is released only when every token in it is dead. Logical token ``i`` then sits at its original
slot ``i``, in block ``i // block_size``; the block being filled (holding logical ``num_logical - 1`` and
waiting for the next token) is held too, even if its tokens are dead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vtoken.core.token_table import TokenTable


def naive_retained_blocks(live_mask: np.ndarray, block_size: int) -> int:
    """Blocks Naive-Evict still holds for a request with this logical liveness."""
    live_mask = np.asarray(live_mask, dtype=bool)
    n = live_mask.size
    if n == 0:
        return 0
    full = n // block_size
    # A block is held if any of its tokens is live: reduce each block's slice with any().
    held = int(np.count_nonzero(live_mask[: full * block_size].reshape(full, block_size).any(axis=1)))
    if n % block_size:
        held += 1  # the block being filled stays allocated for the next token
    return held


def floor_blocks(num_live: int, block_size: int) -> int:
    """The fewest blocks that can hold ``num_live`` tokens."""
    return -(-num_live // block_size)


class BlockCounts(NamedTuple):
    logical: int
    live: int
    retained: int  # vToken: blocks for the packed physical slots
    naive_retained: int  # Naive-Evict: blocks with a live token at its original slot
    floor: int  # ceil(live / block_size)


def block_counts(table: TokenTable) -> BlockCounts:
    return BlockCounts(
        table.num_logical,
        table.num_live,
        table.num_blocks,
        naive_retained_blocks(table.live_mask(), table.block_size),
        floor_blocks(table.num_live, table.block_size),
    )
