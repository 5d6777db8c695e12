"""Compactor: where a token's life is decided each step and where the survivors are packed. No vLLM import.

The engine's scheduler (vtoken/vllm_adapter/scheduler.py) and the property tests (tests/kvsim.py) drive this
same code, one engine step at a time:

    before vLLM schedules   plan_step(progress)    sync each TokenTable with the tokens computed so far; at a
                                                   prefill chunk boundary or a decode step, let the policy
                                                   evict; plan the compaction; shrink the block list; free
                                                   the emptied blocks (naive mode: hold Naive-Evict's ballast)
    after vLLM scheduled    scheduled(rid, n, ...)  a forward of n new tokens runs: record it, and say which
                                                   queries the worker scores and whether it sends them back
    after the forward       receive_stats(rid, s)  attention statistics per physical slot
    at the end              remove(rid)            finished or preempted (preemption recomputes from token 0)

The pool is anything with vLLM's BlockPool methods ``get_new_blocks(n)``, ``free_blocks(blocks)``,
``get_num_free_blocks()`` and ``evict_blocks(block_ids)`` (drop prefix-cache entries); blocks have
``block_id`` and ``ref_cnt``. ``blocks_of(rid)`` returns the request's block list, which the compactor shrinks
in place (vLLM's ``req_to_blocks[rid]``).

A forward is a PREFILL chunk while the request (re)computes the tokens it had when it was admitted (the prompt;
after a preemption, the prompt and the outputs so far); after that, every forward is a decode step. Eviction:
  * at a chunk boundary (``prefill_evict``), among the tokens computed so far, with policy step 0;
  * at decode step s (the s-th output token has been sampled), every ``interval`` steps, as before.
A policy that needs attention statistics evicts only with statistics from the forward just run: a decode
query, or the observation window (the last ``window`` queries) of the chunk just computed. A policy with
``score_every`` = k > 1 has only every k-th decode step observed, so it evicts only after those. These timing
rules live in one place, vtoken/schedule.py.

Two options change the rules:
  * parking (``tier``, vtoken/park.py): what a chunk boundary drops waits in a second tier outside the pool;
    at the boundary after the last chunk the survivors are chosen among live and parked tokens together, by
    the last chunk's window (the question), and parked survivors come back;
  * ``pressure``: the budget is a floor, not a target. A request keeps every token until the pool runs short
    (``plan_step``'s ``shortfall``: blocks the running and waiting requests need beyond the free ones); then
    requests shed, one at a time, until the shortfall is covered. A request that sheds keeps to its budget from
    then on (today's rule), so its peak is bounded from its first shed on. Order: requests that have read their
    prompt first (their statistics have seen the question), then those still reading it (with parking what
    they shed is parked); within each, the one holding most above its budget first (fewest requests lose
    tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from vtoken.mover import MoveBatch
from vtoken.park import Parked, TierSlots
from vtoken.planner import CompactionPlan, plan_compaction, to_global_slots
from vtoken.policies import EvictionPolicy, PolicyInput
from vtoken.records import EngineTotals, RequestRecord
from vtoken.schedule import Schedule
from vtoken.token_table import TokenTable

MODES = ("naive", "vtoken")


class Progress(NamedTuple):
    """Where one running request stands when a step begins."""

    request_id: str
    num_computed: int  # logical tokens whose KV exists
    num_output: int  # output tokens sampled so far
    next_tokens: int  # tokens its next forward is expected to write (1 when decoding; naive ballast sizing)


class ScoreAsk(NamedTuple):
    """What the worker computes for one request in this step's forward."""

    queries: int  # how many of the forward's last queries to score (1 for a decode step)
    export: tuple[str, ...]  # statistics to send back after the forward (empty: keep accumulating)
    parked: np.ndarray | None = None  # tier slots scored with the live keys in one softmax (the last chunk)


def _none() -> MoveBatch:
    return MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64))


class StepPlan(NamedTuple):
    moves: MoveBatch  # global slots, all requests, one gather-then-scatter
    keep_blocks: dict[str, int]  # request -> blocks it keeps (its list was truncated)
    gaps: dict[str, int]  # request -> logical - physical length, where it changed
    park: MoveBatch = _none()  # pool slot -> tier slot, read before this step's moves
    restore: MoveBatch = _none()  # tier slot -> pool slot, written after this step's moves


class CompactorError(RuntimeError):
    """The engine and the compactor disagree about a request (a bug, never a user error)."""


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


@dataclass(eq=False)
class RequestState:
    """One request's vToken state.

    Invariants (``Compactor.check_integrity``): the table's physical slots fit the request's blocks; in vtoken
    mode no ballast; ballast blocks belong to no request's block list; once ``dirty`` (a token died) the
    request's blocks are never prefix-cached again (until a preemption starts it over).
    """

    request_id: str  # the engine's id
    policy: EvictionPolicy
    table: TokenTable
    record: RequestRecord
    prefill_len: int  # tokens to compute before the first new output token
    prefill_evict: bool
    window: int  # prefill observation window (queries)
    schedule: Schedule = Schedule()  # when it may evict (vtoken/schedule.py)
    ballast: list = field(default_factory=list)  # naive mode: blocks held as Naive-Evict would
    stats: dict[str, np.ndarray] | None = None  # from the last forward that exported them, per physical slot
    parked: Parked = field(default_factory=Parked)  # tokens waiting in the tier (vtoken/park.py)
    shedding: bool = True  # False in pressure mode until it sheds once; then it keeps to its budget (today's rule)
    gap_sent: int = 0
    dirty: bool = False
    compacted_at: int = -1  # the step of its last compaction: at most one per step (the moves of a step are
    # applied as one simultaneous gather-then-scatter, so a second plan against moved slots would be wrong)

    @property
    def in_prefill(self) -> bool:
        return self.table.num_logical < self.prefill_len

    @property
    def gap(self) -> int:
        return self.table.num_logical - self.table.physical_len

    def keep(self, num_logical: int) -> int:
        """Live tokens the policy may leave at this length: its budget, unless sink and recent hold more."""
        p = self.policy
        return max(p.target(num_logical), min(num_logical, p.sink + p.recent))


class Compactor:
    """``tier``: the parking tier's slots (None: no parking). A request added with ``pressure`` evicts only when
    ``plan_step`` is told the pool runs short (see the module docstring)."""

    def __init__(
        self, mode: str, block_size: int, pool: Any, blocks_of: Callable[[str], list], tier: TierSlots | None = None
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"compactor mode must be one of {MODES}, got {mode!r}")
        self.mode, self.bs, self.pool, self.blocks_of = mode, int(block_size), pool, blocks_of
        self.tier = tier
        self.states: dict[str, RequestState] = {}
        self.totals = EngineTotals()
        self.step = 0
        self._park: list[MoveBatch] = []  # this step's park and restore moves
        self._restore: list[MoveBatch] = []

    # ---------------------------------------------------------------- request life
    def add(
        self,
        request_id: str,
        record: RequestRecord,
        policy: EvictionPolicy,
        prefill_len: int,
        prefill_evict: bool = True,
        window: int = 32,
        pressure: bool = False,
    ) -> RequestState:
        if request_id in self.states:
            raise CompactorError(f"request {request_id} added twice")
        schedule = Schedule.of(policy, prefill_evict, window, eager=pressure)
        st = RequestState(
            request_id, policy, TokenTable(self.bs), record, int(prefill_len), prefill_evict, window, schedule
        )
        st.shedding = not pressure  # "always": keeps to its budget from the start
        self.states[request_id] = st
        return st

    def remove(self, request_id: str, finished: bool) -> RequestState | None:
        """The request finished, or was preempted (then it starts over with a new state). Its ballast goes back
        to the pool; the caller frees its own blocks."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        if st.parked.size:  # preempted (or ended) while reading its prompt: its parked tokens are gone
            self.tier.give(st.parked.tier)
            st.parked.clear()
        if finished:
            st.record.finish(st.table, len(self.blocks_of(request_id)), len(st.ballast))
            self.totals.add_finished(st.record)
        else:
            self.totals.preemptions += 1
            self.totals.preemptions_in_prefill += st.in_prefill
        if st.ballast:
            self.pool.free_blocks(reversed(st.ballast))
            st.ballast = []
        return st

    def receive_stats(self, request_id: str, stats: dict[str, np.ndarray]) -> None:
        st = self.states.get(request_id)
        if st is not None:
            st.stats = stats

    # ---------------------------------------------------------------- before vLLM schedules
    def plan_step(self, progress: Iterable[Progress], shortfall: int = 0) -> StepPlan:
        """``shortfall`` (pressure mode): the blocks that requests waiting to be admitted need, plus a watermark,
        beyond the free ones; the running requests' next forwards are added here, once their tables are synced."""
        self.step += 1
        moves, keep = [], {}
        self._park, self._restore = [], []
        todo = [(p, self.states[p.request_id]) for p in progress if p.request_id in self.states]
        fresh = {}  # statistics are used by the decision that follows them, once
        for p, st in todo:
            self._sync(st, p.num_computed)
            fresh[st.request_id], st.stats = st.stats, None
        for p, st in todo:
            stats = fresh[st.request_id]
            if st.parked.size and st.table.num_logical >= st.prefill_len - 1:
                batch = self._choose_with_parked(st, stats)
            elif not st.shedding:
                continue  # pressure mode: keeps every token until the pool runs short
            else:
                batch = self._evict_by_policy(st, p, stats)
            if batch is not None:
                moves.append(batch)
                keep[st.request_id] = len(self.blocks_of(st.request_id))
        if any(not st.shedding for _, st in todo):
            shortfall += sum(self._need(st, p.next_tokens) for p, st in todo)
        if shortfall > 0:
            for p, st in self._shedding_order(todo, fresh):
                if shortfall <= 0:
                    break
                before, need = len(self.blocks_of(st.request_id)), self._need(st, p.next_tokens)
                st.shedding = True
                st.record.shed_at = st.record.forwards
                batch = self._evict_by_policy(st, p, fresh[st.request_id], shed=True)
                if batch is not None:
                    moves.append(batch)
                    keep[st.request_id] = len(self.blocks_of(st.request_id))
                    # What it gave back, less what its next forward now needs again.
                    shortfall -= before - keep[st.request_id] - (self._need(st, p.next_tokens) - need)
        gaps = {}
        for _, st in todo:
            if st.gap != st.gap_sent:
                gaps[st.request_id] = st.gap_sent = st.gap
        if self.mode == "naive":
            for p, st in todo:
                self._settle_ballast(st, p.next_tokens)
        return StepPlan(MoveBatch.concat(moves), keep, gaps, MoveBatch.concat(self._park),
                        MoveBatch.concat(self._restore))  # fmt: skip

    def _need(self, st: RequestState, writing: int) -> int:
        """Blocks the request's next forward takes from the pool (it writes ``writing`` tokens)."""
        return max(-(-(st.table.physical_len + writing) // self.bs) - len(self.blocks_of(st.request_id)), 0)

    def _evict_by_policy(self, st: RequestState, p: Progress, stats, shed: bool = False) -> MoveBatch | None:
        victims = self._decide(st, p.num_output, stats, shed)
        if victims.size == 0:
            return None
        park = self.tier is not None and st.in_prefill and bool(st.policy.needs)
        return self.evict(st, victims, step=0 if st.in_prefill else p.num_output, park=park)[0]

    def _shedding_order(self, todo, fresh) -> list[tuple[Progress, RequestState]]:
        """Requests that may shed, in the order they do (module docstring): not yet shedding, over their budget,
        and (attention policies) with statistics from the forward just run."""
        out = []
        for p, st in todo:
            n = st.table.num_logical
            if st.shedding or st.table.num_live <= st.keep(n) or (st.policy.needs and fresh[st.request_id] is None):
                continue
            out.append((st.in_prefill, -(st.table.num_live - st.keep(n)), st.request_id, p, st))
        return [(p, st) for *_, p, st in sorted(out, key=lambda t: t[:3])]

    def _sync(self, st: RequestState, num_computed: int) -> None:
        new = num_computed - st.table.num_logical
        if new < 0:
            raise CompactorError(
                f"request {st.request_id} has {num_computed} computed tokens but its TokenTable holds "
                f"{st.table.num_logical}: state diverged"
            )
        if new:
            st.table.append(new)

    def _decide(
        self, st: RequestState, num_output: int, stats: dict[str, np.ndarray] | None, shed: bool = False
    ) -> np.ndarray:
        none = np.empty(0, dtype=np.int64)
        step = st.schedule.step_at(st.table.num_logical, st.prefill_len, num_output)
        if step is None:
            return none
        if shed:
            step = 0  # shedding is not bound to the interval: the pool is short now
        policy = st.policy
        if policy.needs and stats is None:
            return none
        live = st.table.live_logical()
        named = {}
        if policy.needs:
            slots = st.table.slot_of[live]
            named = {name: stats[name][slots] for name in policy.needs}
        inp = PolicyInput(st.table.num_logical, step, live, named, self._protected(st, live), st.record.seed)
        return policy.select(inp)

    def _protected_blocks(self, st: RequestState) -> int:
        """Blocks at the head of the request's list that are never evicted from or moved: every block up to the
        last one another request also holds (ref_cnt > 1, e.g. a cached prefix). Shared blocks are a prefix in
        the usual case; after a cache entry was dropped mid-prefix, vLLM can hand a later request a mix of
        copies, and a private block between two shared ones is then kept whole too (the planner moves nothing
        below the protected length)."""
        shared = np.flatnonzero([b.ref_cnt > 1 for b in self.blocks_of(st.request_id)])
        return int(shared[-1]) + 1 if shared.size else 0

    def _protected(self, st: RequestState, live: np.ndarray) -> np.ndarray | None:
        """Tokens in protected blocks are never evicted (the paper's rule for shared blocks)."""
        n = self._protected_blocks(st)
        if not n:
            return None
        return st.table.slot_of[live] < n * self.bs

    def evict(self, st: RequestState, victims: np.ndarray, step: int = 0, park: bool = False) -> tuple[MoveBatch, int]:
        """Kill ``victims`` (logical positions), pack the survivors, shrink the block list, free what emptied.
        Returns the moves (global slots) and the blocks the request keeps. Used by ``plan_step``, and directly by
        tests that choose victims themselves. ``park``: victims go to the tier while it has room (their pool
        slots are read before this step's moves), the rest die."""
        return self._compact(st, victims, step, park)

    def _compact(
        self, st: RequestState, victims: np.ndarray, step: int, park: bool, restore: np.ndarray | None = None
    ) -> tuple[MoveBatch, int]:
        if st.compacted_at == self.step:
            raise CompactorError(f"request {st.request_id} compacted twice in step {self.step}")
        st.compacted_at = self.step
        blocks = self.blocks_of(st.request_id)
        ids = [b.block_id for b in blocks]
        packed = kill_and_pack(st.table, victims, ids, self.bs, self._protected_blocks(st))
        holes, plan = packed.holes, packed.plan
        tier = self.tier.take(len(victims)) if park else np.empty(0, np.int64)
        if tier.size:  # parked: hidden from the next forward on, kept in the tier
            st.parked.add(victims[: tier.size], tier, st.record.forwards)
            self._park.append(MoveBatch(to_global_slots(holes[: tier.size], ids, self.bs), tier))
            self.totals.tokens_parked += int(tier.size)
        st.record.record_deaths(victims[tier.size :], step)
        self.totals.tokens_evicted += len(victims) - int(tier.size)
        st.dirty = True
        # A block that lost or gained tokens must never be offered as a prefix-cache hit again
        # (vLLM: BlockPool.evict_blocks drops the hash and keeps the block).
        touched = np.unique(np.concatenate([holes, plan.src, plan.dst]) // self.bs)
        self.pool.evict_blocks({ids[i] for i in touched.tolist()})
        kept = plan.keep_blocks
        if restore is not None and restore.size:  # parked survivors come back right after the packed survivors
            slots = np.arange(plan.physical_len, plan.physical_len + restore.size)
            st.table.revive(st.parked.logical[restore], slots)
            self._restore.append(MoveBatch(st.parked.tier[restore], to_global_slots(slots, ids, self.bs)))
            st.record.record_restored(st.parked.logical[restore], st.parked.at_forward[restore])
            kept = -(-st.table.physical_len // self.bs)
        # Blocks past the packed length are empty now; the engine adds back the block the next token needs.
        freed = blocks[kept:]
        del blocks[kept:]
        if freed:
            if self.mode == "naive":
                st.ballast.extend(freed)  # settled against Naive-Evict in plan_step
            else:
                self.pool.free_blocks(reversed(freed))  # LIFO: the pool hands out recently freed blocks first
                self.totals.blocks_freed += len(freed)
        st.record.tokens_moved += plan.num_moves
        self.totals.tokens_moved += plan.num_moves
        return packed.moves, kept

    def _choose_with_parked(self, st: RequestState, stats: dict[str, np.ndarray] | None) -> MoveBatch | None:
        """The boundary after the last chunk of a request with parked tokens: the policy chooses among live and
        parked tokens by the last chunk's window over both (its ``parked:<name>`` statistics); live losers die,
        parked winners come back into the slots the packing frees, parked losers are freed for good (evicted
        from the forward that parked them). Without those statistics (not expected) every parked token is
        freed and the live ones are judged as without parking."""
        parked = st.parked
        names = st.policy.needs
        if stats is None or any(f"parked:{n}" not in stats for n in names):
            self._discard(st, np.arange(parked.size))
            return None
        live = st.table.live_logical()
        slots = st.table.slot_of[live]
        everyone = np.concatenate([live, parked.logical])
        order = np.argsort(everyone, kind="stable")
        named = {n: np.concatenate([stats[n][slots], stats[f"parked:{n}"]])[order] for n in names}
        protected = self._protected(st, live)
        if protected is not None:
            protected = np.concatenate([protected, np.zeros(parked.size, bool)])[order]
        inp = PolicyInput(st.table.num_logical, 0, everyone[order], named, protected, st.record.seed)
        victims = st.policy.select(inp)
        is_parked = np.isin(parked.logical, victims)
        lose = np.flatnonzero(is_parked)
        win = np.flatnonzero(~is_parked)
        room = len(self.blocks_of(st.request_id)) * self.bs - (live.size - int(np.isin(live, victims).sum()))
        lose, win = np.concatenate([lose, win[room:]]), win[:room]  # (never expected: room for every winner)
        dead = victims[~np.isin(victims, parked.logical)]  # before the discard, which may clear ``parked``
        self._discard(st, lose)
        batch, _ = self._compact(st, dead, 0, park=False, restore=win)
        self.tier.give(parked.tier[win])
        parked.clear()
        return batch

    def _discard(self, st: RequestState, which: np.ndarray) -> None:
        """Parked tokens freed for good: evicted, in the trace, from the forward that parked them."""
        p = st.parked
        if which.size:
            st.record.record_deaths(p.logical[which], 0, at_forward=p.at_forward[which])
            self.totals.tokens_evicted += int(which.size)
            self.tier.give(p.tier[which])
        if which.size == p.size:
            p.clear()

    def _settle_ballast(self, st: RequestState, writing: int) -> None:
        """Naive mode: hold exactly the blocks Naive-Evict would hold beyond what the packed layout needs, for
        the forward that writes ``writing`` new tokens. Extra ballast goes back to the pool; missing ballast is
        taken from it while it lasts."""
        packed = -(-(st.table.physical_len + writing) // self.bs)
        want = max(st.table.naive_blocks(writing) - packed, 0)
        held = st.ballast
        if len(held) > want:
            extra = held[want:]
            del held[want:]
            self.pool.free_blocks(reversed(extra))
        elif len(held) < want:
            n = min(want - len(held), self.pool.get_num_free_blocks())
            if n:
                held.extend(self.pool.get_new_blocks(n))

    # ---------------------------------------------------------------- after vLLM scheduled
    def stop_short(self, request_id: str, new_tokens: int, num_computed_after: int) -> bool:
        """Should this forward stop one token before the end of the prompt? Yes for a request with parked tokens
        whose forward would read its last prompt token: the forward that samples the first output must come after
        the choice among live and parked tokens, or the answer's first token is read without the parked facts."""
        st = self.states.get(request_id)
        return bool(st and st.parked.size and new_tokens > 1 and num_computed_after == st.prefill_len)

    def scheduled(self, request_id: str, new_tokens: int, num_computed_after: int, num_output: int) -> ScoreAsk | None:
        """A forward of ``new_tokens`` tokens runs this step (vLLM already counted them as computed and allocated
        their blocks). Records it and returns what the worker should score, or None."""
        st = self.states[request_id]
        before = num_computed_after - new_tokens
        prefill = before < st.prefill_len
        self._sync(st, before)  # a prefix-cache hit at admission: those tokens' KV exists already
        table = st.table
        live = table.num_live
        held = len(self.blocks_of(request_id)) + len(st.ballast)
        naive = table.naive_blocks(new_tokens)
        bound = -(-(st.keep(before) + new_tokens) // self.bs) + 1
        st.record.forward(new_tokens, prefill, held, naive, -(-(live + new_tokens) // self.bs), bound)
        policy, sched = st.policy, st.schedule
        if not policy.needs:
            return None
        if not prefill:  # decode: accumulate every observed step, send back when the next step may evict
            observe, export = sched.decode_ask(num_output + 1)  # the decode step this forward completes
            return ScoreAsk(1, policy.needs if export else ()) if observe else None
        over = live + new_tokens > policy.target(num_computed_after)
        queries = sched.chunk_queries(new_tokens, num_computed_after, st.prefill_len, num_output, over)
        if st.parked.size and num_computed_after == st.prefill_len - 1:
            # All but the prompt's last token: its window (the question) is scored over live and parked keys in
            # one softmax; the choice follows, and the last token's forward, which samples, sees the survivors.
            return ScoreAsk(min(st.window, new_tokens), policy.needs, st.parked.tier.copy())
        return ScoreAsk(queries, policy.needs) if queries else None

    # ---------------------------------------------------------------- observability
    def pool_totals(self) -> tuple[int, int, int]:
        """(live tokens, retained blocks, Naive-Evict's blocks) over every request: O(requests + blocks)."""
        live = retained = naive = 0
        for st in self.states.values():
            live += st.table.num_live
            retained += len(self.blocks_of(st.request_id)) + len(st.ballast)
            naive += st.table.naive_blocks()
        return live, retained, naive

    def check_integrity(self, moves: MoveBatch | None = None) -> None:
        """Blocks against TokenTables, ballast disjoint from every block list, a step's moves well formed."""
        owned: dict[int, str] = {}
        for rid, st in self.states.items():
            st.table.check_integrity()
            blocks = self.blocks_of(rid)
            if st.table.num_blocks > len(blocks):
                raise CompactorError(
                    f"{rid}: {st.table.physical_len} slots need {st.table.num_blocks} blocks, it holds {len(blocks)}"
                )
            if self.mode == "vtoken" and st.ballast:
                raise CompactorError(f"{rid}: ballast in vtoken mode")
            for b in [*blocks, *st.ballast]:
                if b.ref_cnt == 1 and owned.setdefault(b.block_id, rid) != rid:
                    raise CompactorError(f"block {b.block_id} held by {owned[b.block_id]} and {rid}")
            ballast_ids = {b.block_id for b in st.ballast}
            if ballast_ids & {b.block_id for b in blocks}:
                raise CompactorError(f"{rid}: a ballast block is also in its block list")
        if moves is not None:
            moves.check()
        if self.tier is not None:
            self.tier.check_integrity(np.concatenate([np.empty(0, np.int64)] + [
                st.parked.tier for st in self.states.values()]))  # fmt: skip
