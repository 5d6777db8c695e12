"""Recall: parked tokens chosen back into the pool, and the parking tier's one rule for what leaves it. Plain
NumPy, on the scheduler's side; the compactor (vtoken/core/compactor.py) holds one ``Recall`` and calls it, and
every token it brings back or parks goes through the compactor's one compaction (``compact``), so a request
still changes at most once a step.

Parked tokens come back three ways (vtoken/core/park.py has the timeline):

    with the question   a ``choosing`` request's window over its live and parked keys (one softmax) chooses
                        among both (``choose``; the compactor then changes its phase)
    while decoding      recall: its window of recent decode queries, scored over live and parked keys, chooses
                        again (``while_decoding``); a decoding request keeps to its budget, a keeping one
                        (pressure mode) as many tokens as it holds, less its share of the step's shortfall
                        when the pool is short (the losers parked), so live winners swap with parked losers
    room again          re-inflation (pressure mode): when the pool has room beyond the watermark and nothing
                        waits, parked tokens come back, the best first across requests, into blocks taken from
                        the pool for them (``reinflation`` chooses, ``reinflate`` brings back)

When the tier is full, the oldest parked tokens of any request are freed for good first (``take``,
``make_room``): one rule for what leaves the tier, whichever decision parks. A parked token freed for good dies,
in the trace, at the forward that parked it (``discard``).

Invariants (``Compactor.check_integrity``): a parked token is not live; its tier slot is held by it alone; a
token restored lands right after its request's packed survivors, in blocks the request holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from vtoken.core.move_batch import MoveBatch
from vtoken.core.packing import protected_tokens
from vtoken.core.park import TierSlots
from vtoken.core.phase import Phase
from vtoken.core.policies import PolicyInput
from vtoken.core.records import EngineTotals
from vtoken.core.request_state import RequestState


class Restore(NamedTuple):
    """Parked tokens coming back into the pool: their logical positions, tier slots and the forwards that parked
    them (taken out of ``Parked`` already)."""

    logical: np.ndarray
    tier: np.ndarray
    at_forward: np.ndarray


# The compactor's one kill-park-pack-restore of a request in a step (Compactor._compact):
# (request, victims, policy step, park the victims?, tokens restored) -> (moves, blocks it keeps)
Compact = Callable[[RequestState, np.ndarray, int, bool, "Restore | None"], tuple[MoveBatch, int]]


def recalls(st: RequestState, stats: dict[str, np.ndarray] | None) -> bool:
    """A decoding request whose window was just scored over its parked tokens too: it chooses again."""
    return (
        stats is not None
        and "parked:slots" in stats
        and not st.in_prefill
        and st.phase in (Phase.DECODING, Phase.KEEPING)
    )


def parked_while_reading(st: RequestState) -> bool:
    """Tokens parked before the prompt's last forward (a shed at the boundary right after it is a decoding
    request's): what the choice with the question chooses among."""
    return bool((st.parked.at_forward < len(st.record.prefill_chunks)).any())


def parked_scores(st: RequestState, stats: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    """Each parked token's ``parked:<name>`` statistic, by the tier slot it was scored at (``parked:slots``;
    without it, in parking order). A token parked after the scoring has none (-inf: it stays parked)."""
    asked = stats.get("parked:slots")
    out = {}
    for n in names:
        values = np.asarray(stats[f"parked:{n}"], dtype=np.float64)
        if asked is None:
            out[n] = values[: st.parked.size]
            continue
        asked = np.asarray(asked, dtype=np.int64)
        order = np.argsort(asked, kind="stable")
        at = np.searchsorted(asked[order], st.parked.tier)
        at = np.minimum(at, asked.size - 1)
        found = asked[order][at] == st.parked.tier
        out[n] = np.where(found, values[order][at], -np.inf)
    return out


class Recall:
    """The tier's side of the compactor. ``tier``: its slots (None: no parking, and nothing here is called);
    ``states``: the compactor's requests (the oldest parked tokens of any of them make room); ``blocks_of``,
    ``pool``, ``totals``: the compactor's; ``compact``: the compactor's one compaction of a request in a step."""

    def __init__(
        self,
        tier: TierSlots | None,
        block_size: int,
        pool: Any,
        blocks_of: Callable[[str], list],
        states: dict[str, RequestState],
        totals: EngineTotals,
        compact: Compact,
    ) -> None:
        self.tier, self.bs, self.pool, self.blocks_of = tier, block_size, pool, blocks_of
        self.states, self.totals, self.compact = states, totals, compact

    # ---------------------------------------------------------------- the tier's slots
    def take(self, n: int, step: int) -> np.ndarray:
        """Up to ``n`` tier slots; when the tier has fewer free, the oldest parked tokens of any request are freed
        for good to make room (tokens parked in this very ``step`` are not: their copies are already planned)."""
        short = n - self.tier.num_free
        if short > 0:
            self.make_room(short, step)
        return self.tier.take(n)

    def make_room(self, n: int, step: int) -> None:
        """The tier is full: free the ``n`` oldest parked tokens (by ``Parked.seq``, across requests; ties: the
        request admitted first), each evicted from the forward that parked it. One rule for what leaves the tier."""
        who, idx, seq = [], [], []
        for st in self.states.values():
            old = np.flatnonzero(st.parked.seq < step)
            if old.size:
                who += [st] * old.size
                idx.append(old)
                seq.append(st.parked.seq[old])
        if not who:
            return
        idx, seq = np.concatenate(idx), np.concatenate(seq)
        order = np.argsort(seq, kind="stable")[:n]
        owners = np.array([id(st) for st in who], dtype=np.int64)[order]
        for st in {id(s): s for s in who}.values():
            mine = idx[order][owners == id(st)]
            if mine.size:
                self.discard(st, mine)
                self.totals.tokens_dropped_full += int(mine.size)

    def discard(self, st: RequestState, which: np.ndarray) -> None:
        """Parked tokens freed for good: evicted, in the trace, from the forward that parked them."""
        p = st.parked
        which = np.asarray(which, dtype=np.int64)
        if not which.size:
            return
        st.record.record_deaths(p.logical[which], 0, at_forward=p.at_forward[which], at_step=p.at_step[which])
        self.totals.tokens_evicted += int(which.size)
        self.tier.give(p.tier[which])
        p.drop(which)

    def forget(self, st: RequestState, failed: bool) -> None:
        """The request ends (finished or preempted) with tokens parked: hidden since they were parked, now gone.
        A ``failed`` request's record may be half updated: its slots go back without a word in its trace."""
        if not st.parked.size:
            return
        if failed:
            self.tier.give(st.parked.tier)
            st.parked.clear()
        else:
            self.discard(st, np.arange(st.parked.size))

    # ---------------------------------------------------------------- choices among live and parked tokens
    def while_decoding(self, st: RequestState, stats: dict[str, np.ndarray], num_output: int, shed: int = 0):
        """Recall while decoding: the request's decode window scored over its live and parked keys (one softmax)
        chooses again among both. A decoding request keeps to its budget (the decision its decode step was due
        anyway), a keeping one (pressure mode) as many tokens as it holds, less ``shed`` (its share of a
        shortfall, ``Compactor._shed``): parked winners swap with live losers, so the live count, and the blocks,
        stay the same, or shrink by what the pool is short."""
        keep = st.keep(st.table.num_logical) if st.phase is Phase.DECODING else st.table.num_live - shed
        self.totals.recalls += 1
        return self.choose(st, stats, keep, step=num_output)

    def choose(self, st: RequestState, stats, keep: int | None, step: int) -> MoveBatch | None:
        """The policy chooses among live and parked tokens by a window over both (``parked:<name>`` statistics,
        aligned with the tier slots it scored): live losers are parked (they die only when the tier has no room),
        parked winners come back into the slots the packing frees, parked losers stay parked. ``keep``: live tokens
        after the choice (None: the budget's target). Without parked statistics (not expected) nothing changes."""
        parked = st.parked
        names = st.policy.needs
        if stats is None or any(f"parked:{n}" not in stats for n in names) or not parked.size:
            return None
        scored = parked_scores(st, stats, names)
        live = st.table.live_logical()
        slots = st.table.slot_of[live]
        everyone = np.concatenate([live, parked.logical])
        order = np.argsort(everyone, kind="stable")
        named = {n: np.concatenate([stats[n][slots], scored[n]])[order] for n in names}
        blocks = self.blocks_of(st.request_id)
        protected = protected_tokens(st.table, live, blocks, self.bs)
        if protected is not None:
            protected = np.concatenate([protected, np.zeros(parked.size, bool)])[order]
        inp = PolicyInput(st.table.num_logical, 0, everyone[order], named, protected, st.record.seed)
        victims = st.policy.select(inp, keep=keep)
        parked.score = scored[names[0]]
        win = np.flatnonzero(~np.isin(parked.logical, victims))
        room = len(blocks) * self.bs - (live.size - int(np.isin(live, victims).sum()))
        win = win[np.argsort(-parked.score[win], kind="stable")][: max(room, 0)]  # (never expected: no room)
        dead = victims[~np.isin(victims, parked.logical)]
        if not dead.size and not win.size:
            return None
        back = Restore(parked.logical[win], parked.tier[win], parked.at_forward[win])
        parked.drop(win)
        self.totals.tokens_recalled += int(win.size) if step else 0
        batch, _ = self.compact(st, np.sort(dead), step, self.tier is not None, back)
        return batch

    # ---------------------------------------------------------------- re-inflation
    @staticmethod
    def may_reinflate(st: RequestState, step: int) -> bool:
        """A pressure-mode request that has read its prompt, holds parked tokens and was not compacted in this
        ``step``. (A request in ``always`` mode keeps to its budget: its bound is what its user asked for.)"""
        return bool(st.phase is Phase.KEEPING and not st.in_prefill and st.parked.size and st.compacted_at != step)

    def reinflation(self, keepers: list[tuple[Any, RequestState]], spare: int) -> list[tuple[Any, np.ndarray]]:
        """Which parked tokens come back (indices into each request's ``Parked``), the best first (their latest
        scores; across requests), as many as ``spare`` new blocks hold. ``keepers``: (progress, request), each one
        that ``may_reinflate``. Returns (progress, request), indices for each request that gets any."""
        owner = np.concatenate([np.full(st.parked.size, i) for i, (_, st) in enumerate(keepers)])
        index = np.concatenate([np.arange(st.parked.size) for _, st in keepers])
        score = np.concatenate([st.parked.score for _, st in keepers])
        order = np.lexsort((index, owner, -score))  # best first; ties: the request first, then the oldest parked
        owner, index = owner[order], index[order]
        # the c-th token taken for a request needs a new block when it lands at the start of one past its blocks
        by_owner = np.argsort(owner, kind="stable")
        rank = np.empty(owner.size, np.int64)
        starts = np.searchsorted(owner[by_owner], np.arange(len(keepers)))
        rank[by_owner] = np.arange(owner.size) - np.repeat(starts, np.diff(np.append(starts, owner.size)))
        phys = np.array([st.table.physical_len for _, st in keepers])[owner]
        room = np.array([len(self.blocks_of(st.request_id)) * self.bs for _, st in keepers])[owner]
        at = phys + rank  # the slot the token lands in
        new_block = (at >= room) & ((at - room) % self.bs == 0)
        taken = np.cumsum(new_block) <= spare
        out = []
        for i, keeper in enumerate(keepers):
            mine = index[taken & (owner == i)]
            if mine.size:
                out.append((keeper, mine))
        return out

    def reinflate(self, st: RequestState, mine: np.ndarray, step: int) -> MoveBatch:
        """The parked tokens at ``mine`` come back, into blocks taken from the pool for them (policy step
        ``step``). Returns the request's moves; its block list has grown in place."""
        blocks = self.blocks_of(st.request_id)
        need = -(-(st.table.physical_len + mine.size) // self.bs) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        back = Restore(st.parked.logical[mine], st.parked.tier[mine], st.parked.at_forward[mine])
        st.parked.drop(mine)
        self.totals.tokens_reinflated += int(mine.size)
        return self.compact(st, np.empty(0, np.int64), step, False, back)[0]
