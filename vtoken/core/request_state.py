"""RequestState: one request's vToken state on the compactor. Plain Python and NumPy, no vLLM, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from vtoken.core.budget import kept_tokens
from vtoken.core.park import Parked
from vtoken.core.phase import Phase
from vtoken.core.policies import EvictionPolicy
from vtoken.core.records import RequestRecord
from vtoken.core.schedule import Schedule
from vtoken.core.token_table import TokenTable


@dataclass(eq=False)
class RequestState:
    """One request's vToken state.

    Invariants (``Compactor.check_integrity``): the table's physical slots fit the request's blocks; in vtoken
    mode no ballast; ballast blocks belong to no request's block list; once ``dirty`` (a token died) the
    request's blocks are never prefix-cached again (until a preemption starts it over); a parked token is not
    live, and its tier slot is held by it alone.
    """

    request_id: str  # the engine's id
    policy: EvictionPolicy
    table: TokenTable
    record: RequestRecord
    prefill_len: int  # tokens to compute before the first new output token
    prefill_evict: bool
    window: int  # prefill observation window (queries)
    schedule: Schedule = Schedule()  # when it may evict (vtoken/core/schedule.py)
    phase: Phase = Phase.READING  # what it does at a decision point (vtoken/core/phase.py); changed by Compactor._to
    ballast: list = field(default_factory=list)  # naive mode: blocks held as Naive-Evict would
    stats: dict | None = None  # from the last forward that exported them, per physical slot
    known: dict | None = None  # pressure mode: the latest statistics per logical token (inf: never covered)
    window_scored_at: int = -1  # pressure mode: logical length when its decode window was last scored
    parked: Parked = field(default_factory=Parked)  # tokens waiting in the tier (vtoken/core/park.py)
    chose: bool = False  # it chose among live and parked tokens with its question (once a run)
    recalled_at: int = 0  # the decode step of its last recall (vtoken/core/schedule.py recall_every)
    asked_parked: bool = False  # its window is being scored over its parked tokens too (a recall comes next)
    gap_sent: int = 0
    dirty: bool = False
    floor: float = 0.0  # pressure_floor: the share of its tokens admission keeps for it (0: always mode, or none)
    tier_need: int = 0  # what it may park at most: the tier's admission reserves it (Compactor.tier_admissible)
    compacted_at: int = -1  # the step of its last compaction: at most one per step (the moves of a step are
    # applied as one simultaneous gather-then-scatter, so a second plan against moved slots would be wrong)

    @property
    def in_prefill(self) -> bool:
        return self.table.num_logical < self.prefill_len

    @property
    def gap(self) -> int:
        return self.table.num_logical - self.table.physical_len

    def keep(self, num_logical: int) -> int:
        """Live tokens the policy may leave at this length (vtoken/core/budget.py)."""
        p = self.policy
        return kept_tokens(num_logical, p.budget, p.sink, p.recent)
