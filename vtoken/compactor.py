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
``score_every`` = k > 1 has only every k-th decode step observed, so it evicts only after those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from vtoken.mover import MoveBatch
from vtoken.planner import plan_compaction, to_global_slots
from vtoken.policies import EvictionPolicy, PolicyInput
from vtoken.records import EngineTotals, RequestRecord
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


class StepPlan(NamedTuple):
    moves: MoveBatch  # global slots, all requests, one gather-then-scatter
    keep_blocks: dict[str, int]  # request -> blocks it keeps (its list was truncated)
    gaps: dict[str, int]  # request -> logical - physical length, where it changed


class CompactorError(RuntimeError):
    """The engine and the compactor disagree about a request (a bug, never a user error)."""


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
    ballast: list = field(default_factory=list)  # naive mode: blocks held as Naive-Evict would
    stats: dict[str, np.ndarray] | None = None  # from the last forward that exported them, per physical slot
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
    def __init__(self, mode: str, block_size: int, pool: Any, blocks_of: Callable[[str], list]) -> None:
        if mode not in MODES:
            raise ValueError(f"compactor mode must be one of {MODES}, got {mode!r}")
        self.mode, self.bs, self.pool, self.blocks_of = mode, int(block_size), pool, blocks_of
        self.states: dict[str, RequestState] = {}
        self.totals = EngineTotals()
        self.step = 0

    # ---------------------------------------------------------------- request life
    def add(
        self,
        request_id: str,
        record: RequestRecord,
        policy: EvictionPolicy,
        prefill_len: int,
        prefill_evict: bool = True,
        window: int = 32,
    ) -> RequestState:
        if request_id in self.states:
            raise CompactorError(f"request {request_id} added twice")
        st = RequestState(request_id, policy, TokenTable(self.bs), record, int(prefill_len), prefill_evict, window)
        self.states[request_id] = st
        return st

    def remove(self, request_id: str, finished: bool) -> RequestState | None:
        """The request finished, or was preempted (then it starts over with a new state). Its ballast goes back
        to the pool; the caller frees its own blocks."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
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
    def plan_step(self, progress: Iterable[Progress]) -> StepPlan:
        self.step += 1
        moves, keep, gaps = [], {}, {}
        todo = [(p, self.states[p.request_id]) for p in progress if p.request_id in self.states]
        for p, st in todo:
            self._sync(st, p.num_computed)
            stats, st.stats = st.stats, None  # statistics are used by the decision that follows them, once
            victims = self._decide(st, p.num_output, stats)
            if victims.size == 0:
                continue
            batch, keep[st.request_id] = self.evict(st, victims, step=0 if st.in_prefill else p.num_output)
            moves.append(batch)
            if st.gap != st.gap_sent:
                gaps[st.request_id] = st.gap_sent = st.gap
        if self.mode == "naive":
            for p, st in todo:
                self._settle_ballast(st, p.next_tokens)
        batch = MoveBatch.concat(moves)
        return StepPlan(batch, keep, gaps)

    def _sync(self, st: RequestState, num_computed: int) -> None:
        new = num_computed - st.table.num_logical
        if new < 0:
            raise CompactorError(
                f"request {st.request_id} has {num_computed} computed tokens but its TokenTable holds "
                f"{st.table.num_logical}: state diverged"
            )
        if new:
            st.table.append(new)

    def _decide(self, st: RequestState, num_output: int, stats: dict[str, np.ndarray] | None) -> np.ndarray:
        none = np.empty(0, dtype=np.int64)
        if st.table.num_logical == 0:
            return none
        if st.in_prefill and not st.prefill_evict:
            return none
        # A chunk boundary, the one after the last chunk included: the interval counts decode steps only.
        step = 0 if st.prefill_evict and st.table.num_logical <= st.prefill_len else num_output
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

    def evict(self, st: RequestState, victims: np.ndarray, step: int = 0) -> tuple[MoveBatch, int]:
        """Kill ``victims`` (logical positions), pack the survivors, shrink the block list, free what emptied.
        Returns the moves (global slots) and the blocks the request keeps. Used by ``plan_step``, and directly by
        tests that choose victims themselves."""
        if st.compacted_at == self.step:
            raise CompactorError(f"request {st.request_id} compacted twice in step {self.step}")
        st.compacted_at = self.step
        holes = st.table.kill(victims)
        st.record.record_deaths(victims, step)
        self.totals.tokens_evicted += len(victims)
        st.dirty = True
        blocks = self.blocks_of(st.request_id)
        ids = [b.block_id for b in blocks]
        plan = plan_compaction(st.table.physical_live_mask(), ids, self.bs, self._protected_blocks(st))
        # A block that lost or gained tokens must never be offered as a prefix-cache hit again
        # (vLLM: BlockPool.evict_blocks drops the hash and keeps the block).
        touched = np.unique(np.concatenate([holes, plan.src, plan.dst]) // self.bs)
        self.pool.evict_blocks({ids[i] for i in touched.tolist()})
        st.table.apply_moves(plan.src, plan.dst, plan.physical_len)
        # Blocks past the packed length are empty now; the engine adds back the block the next token needs.
        freed = blocks[plan.keep_blocks :]
        del blocks[plan.keep_blocks :]
        if freed:
            if self.mode == "naive":
                st.ballast.extend(freed)  # settled against Naive-Evict in plan_step
            else:
                self.pool.free_blocks(reversed(freed))  # LIFO: the pool hands out recently freed blocks first
                self.totals.blocks_freed += len(freed)
        st.record.tokens_moved += plan.num_moves
        self.totals.tokens_moved += plan.num_moves
        batch = MoveBatch(to_global_slots(plan.src, ids, self.bs), to_global_slots(plan.dst, ids, self.bs))
        return batch, plan.keep_blocks

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
        policy = st.policy
        if not policy.needs:
            return None
        if not prefill:  # decode: accumulate every step, send back when the next step may evict
            step = num_output + 1  # the decode step this forward completes
            if step % policy.score_every:  # opt-in: one step in score_every observed; no statistics, no eviction
                return None
            return ScoreAsk(1, policy.needs if step % policy.interval == 0 else ())
        if not st.prefill_evict:
            return None
        # Score the chunk's observation window only if the boundary after it may evict.
        step_after = 0 if num_computed_after <= st.prefill_len else num_output + 1
        if step_after % policy.interval or live + new_tokens <= policy.target(num_computed_after):
            return None
        return ScoreAsk(min(st.window, new_tokens), policy.needs)

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
