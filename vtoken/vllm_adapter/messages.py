"""The small picklable types that cross between vToken's scheduler and its workers each step.

They ride on vLLM's own per-step objects as an extra attribute (``SchedulerOutput.vtoken``,
``ModelRunnerOutput.vtoken``), which survive vLLM's pickling between the EngineCore and worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vtoken.core.move_batch import MoveBatch


@dataclass
class VTokenStep:
    """Scheduler -> worker, once per step, applied before that step's forward."""

    moves: MoveBatch  # global slots, all requests, one batch
    keep_blocks: dict[str, int] = field(default_factory=dict)  # req -> blocks it keeps (tail was freed)
    gaps: dict[str, int] = field(default_factory=dict)  # req -> logical - physical length (changes only)
    observe: dict[str, int] = field(default_factory=dict)  # req -> how many of this forward's last queries to score
    export: dict[str, tuple[str, ...]] = field(default_factory=dict)  # req -> statistics to send back after it
    # Parking (vtoken/core/park.py): pool -> tier before the moves, tier -> pool after them; and the last chunks whose
    # window is scored over live and parked keys together: req -> its tier slots.
    park: MoveBatch = field(default_factory=lambda: MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64)))
    restore: MoveBatch = field(default_factory=lambda: MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64)))
    joint: dict[str, np.ndarray] = field(default_factory=dict)
    # On-demand statistics (vtoken/kv/query_window.py): requests whose decode query joins their window this step, and
    # requests whose window is scored after this forward (req -> statistics to send back).
    record: tuple[str, ...] = ()
    window: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Recall (vtoken/core/recall.py): requests whose window is scored over these tier slots too; tier slots
    # the scheduler freed this step (the tier's page boxes follow); requests whose block list grew (re-inflation).
    window_parked: dict[str, np.ndarray] = field(default_factory=dict)
    tier_freed: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    set_blocks: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class VTokenWorkerOutput:
    """Worker -> scheduler, after the forward: attention statistics per physical slot of each request."""

    stats: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # req -> name -> [physical_len]
    move_seconds: float = 0.0
    bytes_moved: int = 0
    score_seconds: float = 0.0  # host time scoring (the per-step scorer, the last chunks, windows on demand)
    recall_bytes: int = 0  # parked bytes read to score recalls this step (page boxes and candidates' keys)
    recall_seconds: float = 0.0  # host time scoring recalls (part of score_seconds)


def empty_step() -> VTokenStep:
    return VTokenStep(MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64)))
