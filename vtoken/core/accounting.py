"""Block accounting: what a request holds under vToken, under Naive-Evict, and the floor.

Naive-Evict is the paper's paired baseline: the same eviction decisions, but no token ever moves, so a
block is released only when every token in it is dead. Logical token ``i`` then sits at its original
slot ``i``, in block ``i // block_size``; the block being filled (holding logical ``num_logical - 1`` and
waiting for the next token) is held too, even if its tokens are dead.

The compactor in naive mode packs as vToken does and holds the difference as ballast (``settle_ballast``), so the
pool sees what Naive-Evict would hold.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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


def settle_ballast(ballast: list, table: TokenTable, writing: int, block_size: int, pool: Any) -> None:
    """Naive mode's ballast (``ballast``: the request's list, changed in place): hold exactly the blocks
    Naive-Evict would hold beyond what the packed layout needs, for the forward that writes ``writing`` new tokens.
    Extra ballast goes back to ``pool`` (vLLM's BlockPool); missing ballast is taken from it while it lasts."""
    packed = -(-(table.physical_len + writing) // block_size)
    want = max(table.naive_blocks(writing) - packed, 0)
    if len(ballast) > want:
        extra = ballast[want:]
        del ballast[want:]
        pool.free_blocks(reversed(extra))
    elif len(ballast) < want:
        n = min(want - len(ballast), pool.get_num_free_blocks())
        if n:
            ballast.extend(pool.get_new_blocks(n))
