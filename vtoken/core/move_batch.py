"""MoveBatch: one engine step's KV moves as global slots: the message from the decision core to the movers.

Plain NumPy (no torch), so the scheduler side (compactor, planner, parking) builds it without importing the worker's
libraries. A slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MoveBatch:
    """One step's moves for all requests, as global slots. Picklable; crosses scheduler -> worker.

    Invariant (``check``): destinations are distinct; a source may also be a destination (the movers read every
    source before they write any destination)."""

    src: np.ndarray  # int64[n]
    dst: np.ndarray  # int64[n]

    def __post_init__(self) -> None:
        if self.src.shape != self.dst.shape or self.src.ndim != 1:
            raise ValueError(f"src {self.src.shape} and dst {self.dst.shape} must be equal 1-D shapes")

    def __len__(self) -> int:
        return int(self.src.size)

    @staticmethod
    def empty() -> MoveBatch:
        return MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64))

    @staticmethod
    def concat(batches: Sequence[MoveBatch]) -> MoveBatch:
        if not batches:
            return MoveBatch.empty()
        return MoveBatch(
            np.concatenate([b.src for b in batches]).astype(np.int64),
            np.concatenate([b.dst for b in batches]).astype(np.int64),
        )

    def check(self) -> None:
        """Destinations must be distinct: two moves into one slot would race."""
        if np.unique(self.dst).size != self.dst.size:
            raise ValueError("two moves write the same destination slot")
