"""A step's messages around the compactor: where each running request stands when the step begins
(``Progress``, from the engine), the step's plan for the worker (``StepPlan``, one for all requests), and the
plan in the making (``StepWork``, inside ``Compactor.plan_step``). Plain Python and NumPy, as vLLM keeps its
``SchedulerOutput`` apart from its scheduler.

Invariants: a ``StepPlan``'s moves are one simultaneous gather-then-scatter (every source read before any
destination is written), its parks read before them and its restores written after them; it carries nothing of
a request that failed in the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vtoken.core.move_batch import MoveBatch
from vtoken.core.request_state import RequestState


class Progress(NamedTuple):
    """Where one running request stands when a step begins."""

    request_id: str
    num_computed: int  # logical tokens whose KV exists
    num_output: int  # output tokens sampled so far
    next_tokens: int  # tokens its next forward is expected to write (1 when decoding; naive ballast sizing)


class StepPlan(NamedTuple):
    """What the worker applies before this step's forwards, for every request at once, and what vLLM's block
    lists and the engine's gaps follow."""

    moves: MoveBatch  # global slots, all requests, one gather-then-scatter
    keep_blocks: dict[str, int]  # request -> blocks it keeps (its list was truncated)
    gaps: dict[str, int]  # request -> logical - physical length, where it changed
    park: MoveBatch = MoveBatch.empty()  # pool slot -> tier slot, read before this step's moves
    restore: MoveBatch = MoveBatch.empty()  # tier slot -> pool slot, written after this step's moves
    tier_freed: np.ndarray = np.empty(0, np.int64)  # tier slots given back this step (the worker's boxes follow)
    set_blocks: dict[str, list[int]] = {}  # request -> its whole block list, where blocks were added (re-inflation)


@dataclass(eq=False)
class StepWork:
    """One ``plan_step`` in the making, by request: the requests it runs for (``todo``, in the engine's order) and
    what it has planned for them so far. A request that fails leaves it whole, at once (``drop``, called by
    ``Compactor.isolated``): the step's later stages skip it, and the plan carries none of its moves, parks,
    restores, block lists or gaps. So a failure is filtered once, where it happens, not at every use."""

    todo: dict[str, tuple[Progress, RequestState]]
    moves: dict[str, MoveBatch] = field(default_factory=dict)
    park: list[tuple[str, MoveBatch]] = field(default_factory=list)  # pool slot -> tier slot, by request
    restore: list[tuple[str, MoveBatch]] = field(default_factory=list)  # tier slot -> pool slot, by request
    set_blocks: dict[str, list[int]] = field(default_factory=dict)  # whole block lists, where blocks were added

    def running(self) -> list[tuple[Progress, RequestState]]:
        """The requests still in the step (a copy: a stage may drop one while it walks them)."""
        return list(self.todo.values())

    def drop(self, request_id: str) -> None:
        self.todo.pop(request_id, None)
        self.moves.pop(request_id, None)
        self.set_blocks.pop(request_id, None)
        self.park = [(rid, b) for rid, b in self.park if rid != request_id]
        self.restore = [(rid, b) for rid, b in self.restore if rid != request_id]
