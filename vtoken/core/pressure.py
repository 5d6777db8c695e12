"""Pressure mode on the compactor (``evict: "pressure"``): how short the pool is, who may shed and how much, and
whether the pool may run short soon. Plain Python and NumPy; vtoken/core/shedding.py plans the sheds (the order,
and why), the compactor (vtoken/core/compactor.py) holds one ``Pressure``, asks it, and evicts what it plans.

A request in pressure mode keeps every token until the pool runs short. Its shortfall, in blocks:

    waiting requests' first forwards + the watermark - the free blocks       (``waiting_shortfall``)
  + each running request's next forward, beyond the blocks it holds          (``need``)

A shed judges a request's live tokens by the statistics of its latest forward; when a shed comes before fresh
ones, by the latest it was sent, kept by logical token (``remember``, ``known_stats``). A request that chooses
among live and parked tokens in the step (with its question, or a recall) is a candidate too: its choice gives up
its share, the losers parked (``Compactor._shed``). ``foresee`` asks the
worker to score decode windows only when the pool may run short soon, so keeping every token costs a decode step
nothing while memory is plentiful.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from vtoken.core.phase import Phase
from vtoken.core.policies import PolicyInput
from vtoken.core.request_state import RequestState
from vtoken.core.shedding import Holder, floor_tokens, plan_sheds, plan_sheds_above


class Candidate(NamedTuple):
    """A request that may shed now, as ``Pressure.candidate`` found it."""

    holder: Holder  # as the shedding plan sees it
    progress: Any  # where it stands this step (compactor.Progress)
    state: RequestState
    ranked: np.ndarray  # its live tokens (logical positions), the first to shed first
    above: int  # its live tokens above its floor (pressure_floor)


def remember(st: RequestState, stats: dict[str, np.ndarray]) -> None:
    """Keep a forward's statistics by logical token (``st.known``, inf: never covered), for a shed that comes
    before the next statistics do."""
    live = st.table.live_logical()
    slots = st.table.slot_of[live]
    known = st.known or {}
    for name, values in stats.items():
        if name.startswith("parked:") or values.size < st.table.physical_len:
            continue
        column = known.get(name)
        if column is None or column.size < st.table.num_logical:
            grown = np.full(st.table.num_logical, np.inf)
            if column is not None:
                grown[: column.size] = column
            column = grown
        column[live] = values[slots]
        known[name] = column
    st.known = known


def known_stats(st: RequestState) -> dict[str, np.ndarray]:
    """The latest statistics of a request's live tokens, per physical slot; tokens none covered rank as the
    most worth keeping (the newest ones, mostly)."""
    live = st.table.live_logical()
    slots = st.table.slot_of[live]
    out = {}
    for name, column in st.known.items():
        values = np.full(st.table.physical_len, np.inf)
        inside = live < column.size
        values[slots[inside]] = column[live[inside]]
        out[name] = values
    return out


class Pressure:
    """Pressure mode's side of the compactor. ``states``, ``blocks_of``, ``pool``: the compactor's;
    ``policy_input``: what a policy sees of a request at a policy step (Compactor._input)."""

    def __init__(
        self,
        block_size: int,
        pool: Any,
        blocks_of: Callable[[str], list],
        states: dict[str, RequestState],
        policy_input: Callable[[RequestState, int, Any], PolicyInput],
    ) -> None:
        self.bs, self.pool, self.blocks_of, self.states = block_size, pool, blocks_of, states
        self.policy_input = policy_input

    def need(self, st: RequestState, writing: int) -> int:
        """Blocks the request's next forward takes from the pool (it writes ``writing`` tokens)."""
        return max(-(-(st.table.physical_len + writing) // self.bs) - len(self.blocks_of(st.request_id)), 0)

    def waiting_shortfall(self, waiting: Sequence[int], watermark: int) -> int:
        """Blocks the waiting requests' first forwards need, plus the watermark, beyond the free ones."""
        return sum(-(-t // self.bs) for t in waiting) + watermark - self.pool.get_num_free_blocks()

    def candidate(self, st: RequestState, p: Any, stats: dict[str, np.ndarray] | None, step: int) -> Candidate | None:
        """What a request may shed now (``Candidate``), or None: only a request keeping every token (or choosing
        with its question, in pressure mode: its choice sheds too), with statistics to rank its tokens by, not
        compacted in this ``step`` already, at a point its schedule lets it decide. ``p``: its Progress; ``stats``:
        this step's fresh statistics (None: the latest kept, ``known``)."""
        chooses = st.phase is Phase.CHOOSING and st.schedule.eager  # its choice sheds too (plan_step's ``joint``)
        if not (st.phase is Phase.KEEPING or chooses) or (st.policy.needs and stats is None and st.known is None):
            return None
        if st.compacted_at == step:  # compacted already this step (one compaction a step)
            return None
        at = st.schedule.decision_step(st.table.num_logical, st.prefill_len, p.num_output, 0, shed=True)
        if at is None:
            return None
        if stats is None and st.policy.needs:
            stats = known_stats(st)  # the latest statistics it was sent, for the tokens they cover
        ranked = st.policy.ranked(self.policy_input(st, at, stats))
        most = min(st.table.num_live - st.keep(st.table.num_logical), ranked.size)
        if most <= 0:
            return None
        writing = st.table.physical_len + p.next_tokens
        holds = max(len(self.blocks_of(st.request_id)), -(-writing // self.bs))
        n = st.table.num_logical
        above = st.table.num_live - floor_tokens(n, st.keep(n), st.floor)
        return Candidate(Holder(writing, holds, most, st.in_prefill, st.request_id), p, st, ranked, max(above, 0))

    def plan(self, found: list[Candidate], shortfall: int) -> list[int]:
        """Tokens each candidate sheds to cover ``shortfall`` blocks (vtoken/core/shedding.py): above the floors
        first when any candidate has one."""
        holders = [c.holder for c in found]
        if any(c.state.floor > 0 for c in found):
            return plan_sheds_above(holders, [c.above for c in found], shortfall, self.bs)
        return plan_sheds(holders, shortfall, self.bs)

    def foresee(
        self, scheduled: dict[str, int], waiting: Sequence[int], watermark: int, chunk: int, lead: int
    ) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        """Pressure mode, after vLLM scheduled this step: may the pool run short soon? ``scheduled``: this step's
        forwards (request -> new tokens, blocks already allocated); ``waiting``, ``watermark``: as for
        ``plan_step``; ``chunk``: the engine's largest prefill forward; ``lead``: the decode window's length.

        Returns (record, score): the decoding requests that keep every token (on-demand policies) whose query this
        forward adds to their window, because the pool may run short within ``lead`` steps; and those whose window
        is scored after this forward (with the statistics to send back), because it may run short at the next
        step, whose shed then judges the request's live tokens by its recent queries (the window a decision in
        always mode scores), at most once per ``slack`` decode steps a request, as decisions come in always mode.
        While the pool is far from short: nothing, so a request that keeps every token costs its decode steps
        nothing. A shortfall nobody foresaw (a burst of arrivals) sheds by the latest statistics sent."""
        decoders, need_next, need_lead = [], 0, 0  # decoders: (keeper, logical length after, may score again)
        for rid, n in scheduled.items():
            st = self.states.get(rid)
            if st is None:
                continue
            after = st.table.num_logical + n  # this step's forward writes n tokens
            left = st.prefill_len - after
            need_next += self.need(st, n + (min(left, chunk) if left > 0 else 1))  # as plan_step counts it
            need_lead += self.need(st, n + (min(left, chunk * lead) if left > 0 else lead))
            if st.phase is Phase.KEEPING and st.schedule.on_demand and after > st.prefill_len:
                last = st.window_scored_at
                decoders.append((st, after, last < 0 or after - last >= st.schedule.slack))
        base = self.waiting_shortfall(waiting, watermark)
        if not decoders or base + need_lead <= 0:
            return [], {}
        score = {}
        if base + need_next > 0:  # at most once per ``slack`` decode steps a request, as decisions in always mode
            for st, after, ready in decoders:
                if ready:
                    score[st.request_id] = st.policy.needs
                    st.window_scored_at = after
        return [st.request_id for st, _, _ in decoders], score
