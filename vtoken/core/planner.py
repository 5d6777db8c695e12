"""Compaction planner: which live tokens move where, and which blocks are freed.

A request's physical slots after evictions look like this (B = block_size = 4, P = protected blocks):

    block      |  0 (P)  |    1    |    2    |    3    |
    slot        0 1 2 3   4 5 6 7   8 9 10 11 12 13 14
    live        x x x x   x . . x   . x . x   x . x      <- physical_len = 15
                          ^^^^^^^^^^^^^^^^^^^^^^^^^^^ compactable region (6 live)
    packed_len = 4 + 6 = 10      holes below 10: 5 6 8      live at or past 10: 11 12 14
    moves 11->5, 12->6, 14->8; block 3 is freed, physical_len becomes 10

Attention over RoPE'd keys does not depend on the order of the slots, so only the live tokens beyond the
packed length have to move, each into some hole below it: the number of moves equals the number of live
tokens at or beyond ``packed_len``, which is also a lower bound for any plan that keeps the block order.
Protected blocks (shared with other requests, e.g. a cached prefix) are never read from or written to;
they must form a prefix of the block list, which is how vLLM's prefix cache shares blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class CompactionPlan(NamedTuple):
    """Moves for one request, in request-local physical slots (``slot // block_size`` indexes block_ids)."""

    src: np.ndarray  # int64[n_moves]
    dst: np.ndarray  # int64[n_moves]
    physical_len: int  # attended length after the moves
    keep_blocks: int  # the request keeps block_ids[:keep_blocks]
    free_block_ids: list[int]  # block_ids[keep_blocks:], to return to the pool

    @property
    def num_moves(self) -> int:
        return int(self.src.size)


class PlannerError(ValueError):
    """The planner's inputs are inconsistent (bad shapes, protected blocks not a prefix, ...)."""


def _validate(live: np.ndarray, block_ids: list[int], block_size: int, num_protected: int) -> np.ndarray:
    live = np.asarray(live, dtype=bool).ravel()
    if block_size <= 0:
        raise PlannerError(f"block_size must be positive, got {block_size}")
    needed = -(-live.size // block_size)
    if len(block_ids) < needed:
        raise PlannerError(f"{live.size} slots need {needed} blocks, request has {len(block_ids)}")
    if not 0 <= num_protected <= len(block_ids):
        raise PlannerError(f"num_protected {num_protected} outside [0, {len(block_ids)}]")
    return live


def protected_prefix(protected: np.ndarray) -> int:
    """Length of the protected prefix; protected blocks after an unprotected one are an error."""
    protected = np.asarray(protected, dtype=bool).ravel()
    n = int(np.argmin(protected)) if not protected.all() else protected.size
    if protected[n:].any():
        raise PlannerError("protected (shared) blocks must form a prefix of the request's block list")
    return n


def plan_compaction(live: np.ndarray, block_ids: list[int], block_size: int, num_protected: int = 0) -> CompactionPlan:
    """Fewest-moves plan: live tokens beyond the packed length fill the holes below it.

    ``live[s]`` says whether physical slot ``s`` holds a live token (its length is the physical_len).
    Slots inside the first ``num_protected`` blocks are untouched and count as occupied.
    """
    live = _validate(live, block_ids, block_size, num_protected)
    base = min(num_protected * block_size, live.size)
    region = live[base:]
    packed_len = base + int(np.count_nonzero(region))
    holes = np.flatnonzero(~live[base:packed_len]) + base
    movers = np.flatnonzero(live[packed_len:]) + packed_len
    # holes.size == movers.size: both count the dead slots below packed_len's complement.
    return _finish(movers, holes, packed_len, block_ids, block_size, num_protected)


def plan_compaction_reference(
    live: np.ndarray, block_ids: list[int], block_size: int, num_protected: int = 0
) -> CompactionPlan:
    """Simple order-preserving plan for tests: the k-th live slot of the region moves to slot base + k."""
    live = _validate(live, block_ids, block_size, num_protected)
    base = min(num_protected * block_size, live.size)
    src, dst = [], []
    k = base
    for s in range(base, live.size):
        if live[s]:
            if s != k:
                src.append(s)
                dst.append(k)
            k += 1
    return _finish(
        np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), k, block_ids, block_size, num_protected
    )


def _finish(
    src: np.ndarray, dst: np.ndarray, packed_len: int, block_ids: list[int], block_size: int, num_protected: int
) -> CompactionPlan:
    keep = max(-(-packed_len // block_size), num_protected)
    return CompactionPlan(
        src.astype(np.int64), dst.astype(np.int64), int(packed_len), int(keep), list(block_ids[keep:])
    )


def moves_lower_bound(live: np.ndarray, block_size: int, num_protected: int = 0) -> int:
    """Moves any block-order-preserving packing needs: live tokens that lie at or past the packed length."""
    live = np.asarray(live, dtype=bool).ravel()
    base = min(num_protected * block_size, live.size)
    packed_len = base + int(np.count_nonzero(live[base:]))
    return int(np.count_nonzero(live[packed_len:]))


def to_global_slots(local: np.ndarray, block_ids: list[int] | np.ndarray, block_size: int) -> np.ndarray:
    """Request-local slots -> global KV slots (``block_id * block_size + offset``) for the mover."""
    local = np.asarray(local, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    return blocks[local // block_size] * block_size + local % block_size
