"""Compactor: where a token's life is decided each step and where the survivors are packed. No vLLM, no torch.

The engine's scheduler (vtoken/vllm_adapter/scheduler.py) and the property tests (tests/kvsim.py) drive this
same code, one engine step at a time:

    before vLLM schedules   plan_step(progress)    sync each TokenTable with the tokens computed so far; at a
                                                   decision point, let the policy evict; plan the compaction;
                                                   shrink the block list; free the emptied blocks (naive mode:
                                                   hold Naive-Evict's ballast)
    after vLLM scheduled    scheduled(rid, n, ...)  a forward of n new tokens runs: record it, and say which
                                                   queries the worker scores and whether it sends them back
    after the forward       receive_stats(rid, s)  attention statistics per physical slot
    at the end              remove(rid)            finished or preempted (preemption recomputes from token 0)

The pool is anything with vLLM's BlockPool methods ``get_new_blocks(n)``, ``free_blocks(blocks)``,
``get_num_free_blocks()`` and ``evict_blocks(block_ids)`` (drop prefix-cache entries); blocks have
``block_id`` and ``ref_cnt``. ``blocks_of(rid)`` returns the request's block list, which the compactor shrinks
in place (vLLM's ``req_to_blocks[rid]``). The engine's glue reads nothing else of the compactor than its methods
(``gap``, ``may_cache``, ``pressure_active``, ``progress``, ``admit``, ``remove``, ``report`` ...).

A forward is a PREFILL chunk while the request (re)computes the tokens it had when it was admitted (the prompt;
after a preemption, the prompt and the outputs so far); after that, every forward is a decode step. WHEN a request
may evict is vtoken/core/schedule.py's business; WHAT it does then depends on its phase (vtoken/core/phase.py):

    keeping   (pressure mode) nothing until the pool runs short
    reading   evict to the budget at a chunk boundary; with a tier (``tier``, vtoken/core/park.py) the victims are
              parked outside the pool
    choosing  (parked tokens, the question read) choose among live and parked tokens by the last chunk's window;
              parked winners come back into pool slots
    decoding  evict to the budget at decode steps

Pressure mode (``evict: "pressure"``): the budget is a floor, not a target. A request keeps every token until the
pool runs short; then the requests give back exactly what the shortfall needs, with the fewest tokens, each its
lowest-scored ones and never below its budget, and go on keeping the rest (vtoken/core/pressure.py, shedding.py).
A request that chooses in a step (the question, or a recall) gives up its share of that step's shortfall in the
same choice (its one compaction of the step).

The compactor keeps the token table's life: decide (the policy, by phase), pack (``_compact``: the one
kill-park-pack-restore of a request in a step, at most once a step) and plan (``plan_step``: one ``StepPlan`` for
all requests). It holds two small owners and calls them: ``recall`` (vtoken/core/recall.py: the tier's slots, the
choices among live and parked tokens, re-inflation) and ``pressure`` (vtoken/core/pressure.py: the shortfall, who
sheds, the forecast). Admission's rules are vtoken/core/shedding.py's, what the worker scores is
vtoken/core/score_ask.py's, the reports are vtoken/core/reporting.py's. A request whose work raises ends alone
(``isolated``): it leaves the step at once (``StepWork.drop``) and the engine ends it (``take_failed``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from vtoken.core.accounting import settle_ballast
from vtoken.core.budget import forward_bound
from vtoken.core.move_batch import MoveBatch
from vtoken.core.packing import kill_and_pack, protected_blocks, protected_tokens
from vtoken.core.park import TierSlots
from vtoken.core.phase import Phase, check_phase
from vtoken.core.planner import to_global_slots
from vtoken.core.policies import EvictionPolicy, PolicyInput
from vtoken.core.pressure import Pressure, remember
from vtoken.core.recall import Recall, Restore, parked_while_reading, recalls
from vtoken.core.records import EngineTotals, RequestRecord, TraceBook, request_seed
from vtoken.core.reporting import CoreReport, core_report, core_stats
from vtoken.core.request_state import RequestState
from vtoken.core.schedule import Schedule
from vtoken.core.score_ask import ScoreAsk, score_ask
from vtoken.core.shedding import admit_at_floors, admit_to_tier, tier_need
from vtoken.core.step import Progress, StepPlan, StepWork
from vtoken.core.token_table import TokenTable

MODES = ("naive", "vtoken")
logger = logging.getLogger(__name__)


class CompactorError(RuntimeError):
    """The engine and the compactor disagree about a request (a bug, never a user error)."""


class Compactor:
    """``tier``: the parking tier's slots (None: no parking). ``trace``: keep what the audit trail needs across
    preemptions (``remove`` then returns a finished request's trace fields). A request added with ``pressure``
    evicts only when ``plan_step`` finds the pool short (see the module docstring)."""

    def __init__(
        self,
        mode: str,
        block_size: int,
        pool: Any,
        blocks_of: Callable[[str], list],
        tier: TierSlots | None = None,
        trace: bool = False,
        floor: float = 0.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"compactor mode must be one of {MODES}, got {mode!r}")
        self.mode, self.bs, self.pool, self.blocks_of = mode, int(block_size), pool, blocks_of
        self.floor = float(floor)  # pressure_floor of requests added without their own (vtoken/core/shedding.py)
        self.states: dict[str, RequestState] = {}
        self.totals = EngineTotals()
        self.traces = TraceBook() if trace else None
        self.step = 0
        self._work = StepWork({})  # the step in the making (``plan_step``)
        self.recall = Recall(tier, self.bs, pool, blocks_of, self.states, self.totals, self._compact)
        self.pressure = Pressure(self.bs, pool, blocks_of, self.states, self._input)
        # Requests whose decision, compaction or shed raised: each ends alone, with an error (``take_failed``).
        self.failed: dict[str, str] = {}

    @property
    def tier(self) -> TierSlots | None:
        """The parking tier's slots (None: no parking), held by ``recall``."""
        return self.recall.tier

    @tier.setter
    def tier(self, tier: TierSlots | None) -> None:
        self.recall.tier = tier

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
        floor: float | None = None,
        recall_every: int = 0,
        max_len: int = 0,
    ) -> RequestState:
        """``floor``: the request's own ``pressure_floor`` (None: the engine's); only pressure mode has one.
        ``max_len``: its tokens at the longest (prompt and max_tokens; 0: its prompt), what it may park follows.
        ``recall_every``: decode steps between its recalls (with a tier and a window policy; 0: never)."""
        if request_id in self.states:
            raise CompactorError(f"request {request_id} added twice")
        recall = recall_every if self.tier is not None else 0
        schedule = Schedule.of(policy, prefill_evict, window, eager=pressure, block_size=self.bs, recall_every=recall)
        phase = Phase.KEEPING if pressure else Phase.READING  # "always": keeps to its budget from the start
        st = RequestState(
            request_id, policy, TokenTable(self.bs), record, int(prefill_len), prefill_evict, window, schedule, phase
        )
        st.floor = float(self.floor if floor is None else floor) if pressure else 0.0
        st.tier_need = self.tier_need(policy, max(max_len, prefill_len))
        self.states[request_id] = st
        return st

    def admit(
        self,
        request_id: str,
        caller_id: str,
        policy: EvictionPolicy,
        prefill_len: int,
        prefill_evict: bool = True,
        window: int = 32,
        pressure: bool = False,
        prefix_cached: int = 0,
        outputs_at_start: int = 0,
        logprobs: bool = False,
        floor: float | None = None,
        recall_every: int = 0,
        max_len: int = 0,
    ) -> RequestState:
        """A request's first forward (new, or resumed after a preemption: it recomputes ``prefill_len`` tokens,
        prompt and outputs so far, before it samples again). ``caller_id``: the id its trace and records carry.
        ``logprobs``: the request asked for log-probabilities (the trace keeps the sampled tokens'). ``floor``: its
        own ``pressure_floor`` (None: the engine's)."""
        record = RequestRecord(
            caller_id,
            request_seed(caller_id),
            policy=policy.name,
            budget=policy.budget,
            prefix_cached=prefix_cached,
            outputs_at_start=outputs_at_start,
        )
        earlier, so_far = self.traces.resume(request_id) if self.traces else ([], None)
        record.earlier = earlier
        if logprobs:
            record.logprobs = so_far if so_far is not None else []
        return self.add(request_id, record, policy, prefill_len, prefill_evict, window, pressure, floor, recall_every,
                        max_len)  # fmt: skip

    def remove(
        self, request_id: str, finished: bool, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
    ) -> dict[str, Any] | None:
        """The request finished, or was preempted (then it starts over with a new state). Its ballast goes back
        to the pool; the caller frees its own blocks. Returns a finished request's trace line when tracing."""
        st = self.states.pop(request_id, None)
        if st is not None:
            self._forget(st, finished)
        if self.traces is None:
            return None
        return self.traces.ended(request_id, st.record if st is not None else None, finished, prompt_ids, output_ids)

    def _forget(self, st: RequestState, finished: bool) -> None:
        self.recall.forget(st, failed=st.request_id in self.failed)
        if finished:
            if st.request_id not in self.failed:  # a failed request's record may be half updated: not counted
                st.record.finish(st.table, len(self.blocks_of(st.request_id)), len(st.ballast))
                self.totals.add_finished(st.record)
        else:
            self.totals.preemptions += 1
            self.totals.preemptions_in_prefill += st.in_prefill
        if st.ballast:
            self.pool.free_blocks(reversed(st.ballast))
            st.ballast = []

    def receive_stats(self, request_id: str, stats: dict[str, np.ndarray]) -> None:
        """Statistics per physical slot from the forward just run: the next decision's, once. Pressure mode also
        keeps them by logical token (``known``), for a shed that comes before the next statistics do."""
        st = self.states.get(request_id)
        if st is None:
            return
        st.stats = stats
        if st.schedule.eager:
            remember(st, stats)

    # ---------------------------------------------------------------- one request's failure stays its own
    @contextlib.contextmanager
    def isolated(self, request_id: str) -> Iterator[None]:
        """Work for one request: an exception in it (a policy that raises, a bug in a compaction) ends that request
        alone. It is logged with its traceback and named in ``failed``; in a ``plan_step`` it leaves the step at
        once, with its moves, parks and restores (``StepWork.drop``); the engine's glue finishes it with an error
        (``take_failed``), which frees its blocks, while every other request runs on. Without this, one request's
        exception stopped the engine for all of them."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever one request's decision raises is that request's failure
            self._work.drop(request_id)
            if request_id not in self.failed:
                logger.exception("vtoken: request %s failed while vToken decided for it; it ends with an error, "
                                 "the others run on", request_id)  # fmt: skip
                self.failed[request_id] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def take_failed(self) -> dict[str, str]:
        """The requests that failed since the last call (request -> the reason, one line), forgotten here: their
        ballast and parked tokens are released, and no trace line is written for them. The engine then ends each
        with an error and frees its blocks (its ``remove`` finds nothing left to do)."""
        for rid in self.failed:
            st = self.states.pop(rid, None)
            if st is not None:
                self._forget(st, finished=True)
            if self.traces is not None:
                self.traces.finished(rid, None)  # drops what an earlier, preempted run left for the next one
        failed, self.failed = self.failed, {}
        return failed

    # ---------------------------------------------------------------- what the engine's glue asks
    def tracks(self, request_id: str) -> bool:
        """Admitted and not yet finished or preempted."""
        return request_id in self.states

    def gap(self, request_id: str) -> int:
        """Logical minus physical length: vLLM sizes a request's blocks by its physical tokens."""
        st = self.states.get(request_id)
        return 0 if st is None else st.gap

    def may_cache(self, request_id: str) -> bool:
        """May the request's full blocks be hashed into the prefix cache? Not once a token of it died: its blocks
        no longer hold the logical tokens their hash would name."""
        st = self.states.get(request_id)
        return st is None or not st.dirty

    def floored(self) -> bool:
        """The engine or a running request has a pressure_floor: admission keeps the floors (``admissible``)."""
        return self.floor > 0 or any(st.floor > 0 for st in self.states.values())

    def pressure_active(self) -> bool:
        """Some request keeps every token until the pool runs short (pressure mode, before its first shed)."""
        return any(st.phase is Phase.KEEPING for st in self.states.values())

    def progress(self, request_id: str, num_computed: int, num_output: int, chunk: int) -> Progress | None:
        """Where a running request stands (None: not tracked); ``chunk``: the engine's largest prefill forward."""
        st = self.states.get(request_id)
        if st is None:
            return None
        left = st.prefill_len - num_computed
        return Progress(request_id, num_computed, num_output, min(left, chunk) if left > 0 else 1)

    def num_live(self, request_id: str) -> int:
        """The request's live tokens (0: not tracked)."""
        st = self.states.get(request_id)
        return 0 if st is None else st.table.num_live

    def wants_logprobs(self, request_id: str) -> bool:
        st = self.states.get(request_id)
        return self.traces is not None and st is not None and st.record.logprobs is not None

    def add_logprobs(self, request_id: str, logprobs: Sequence[float]) -> None:
        """The sampled tokens' log-probabilities of this step, for the trace."""
        self.states[request_id].record.logprobs.extend(logprobs)

    def decoding_len(self, request_id: str) -> int | None:
        """The physical length of a request that has read its prompt; None otherwise (testing: relocation)."""
        st = self.states.get(request_id)
        return None if st is None or st.in_prefill else st.table.physical_len

    def note_step(self, running: int, seconds: float) -> None:
        """The engine's step: how many requests ran, and the host time spent planning and recording."""
        self.totals.note_step(running, seconds)

    def note_worker(self, move_seconds: float, bytes_moved: int, **kw: Any) -> None:
        """The worker's side of a step (records.py EngineTotals.note_worker: ``tokens_moved``, ``score_seconds``,
        ``recall_bytes``, ``recall_seconds``), and moves made outside the compactor's plans (testing relocation)."""
        self.totals.note_worker(move_seconds, bytes_moved, **kw)

    def stats(self, reset: bool = False, running: int = 0) -> dict[str, Any]:
        """Per-request figures and the engine's totals (vtoken/core/reporting.py core_stats): for tests and
        benchmarks. ``reset``: afterwards start peak_running (at ``running``) and the finished list afresh."""
        return core_stats(self.states, self.blocks_of, self.totals, self.bs, self.tier, reset, running)

    def report(self) -> CoreReport:
        """The compactor in a few numbers, for a replica's frequent pool report (reporting.py core_report)."""
        return core_report(self.states, self.blocks_of, self.totals, self.tier)

    # ---------------------------------------------------------------- before vLLM schedules
    def plan_step(self, progress: Iterable[Progress], waiting: Sequence[int] = (), watermark: int = 0) -> StepPlan:
        """``waiting`` (pressure mode): the tokens the first forward of each request waiting to be admitted reads,
        in the order the engine admits them; ``watermark``: blocks kept free on top of the demand. With them the
        shortfall is taken from the pool as it stands before this step's evictions; the running requests' next
        forwards are added once their tables are synced. A request that fails on the way leaves the step at once
        (``StepWork.drop``): the later stages run for the others only, and the plan carries nothing of it."""
        shortfall = self.pressure.waiting_shortfall(waiting, watermark) if self.pressure_active() else 0
        self.step += 1
        self._work = work = StepWork({p.request_id: (p, self.states[p.request_id]) for p in progress
                                      if p.request_id in self.states})  # fmt: skip
        fresh = {}  # statistics are used by the decision that follows them, once
        for p, st in work.running():
            with self.isolated(st.request_id):
                self._sync(st, p.num_computed)
            fresh[st.request_id], st.stats = st.stats, None
        joint: dict[str, dict] = {}  # pressure mode: requests that choose among live and parked tokens this step
        for p, st in work.running():
            with self.isolated(st.request_id):
                stats = fresh[st.request_id]
                if st.phase is Phase.CHOOSING or recalls(st, stats):
                    if st.schedule.eager:
                        # A choice is the request's one compaction of the step, so it comes after the shed is
                        # planned and gives up the request's share in the same choice; chosen first, the request
                        # could not shed, and a running request's growth found no block (issue 58).
                        joint[st.request_id] = stats
                        continue
                    batch = self._choose_now(st, p, stats)
                elif st.phase is Phase.KEEPING:
                    continue  # pressure mode: keeps every token until the pool runs short
                else:
                    batch = self._evict_by_policy(st, p, stats)
                if batch is not None:
                    work.moves[st.request_id] = batch
        if joint or any(st.phase is Phase.KEEPING for _, st in work.running()):
            # a choice to come keeps the live count, so its blocks: its need counted now holds after it
            shortfall += sum(self.pressure.need(st, p.next_tokens) for p, st in work.running())
        if shortfall > 0:
            for st, batch in self._shed(work.running(), fresh, shortfall, joint):
                work.moves[st.request_id] = batch
        for p, st in work.running():  # the choices the shed left whole
            if st.request_id in joint and st.compacted_at != self.step:
                with self.isolated(st.request_id):
                    batch = self._choose_now(st, p, joint[st.request_id])
                    if batch is not None:
                        work.moves[st.request_id] = batch
        if shortfall <= 0 and not waiting and self.tier is not None and self.mode == "vtoken":
            for st, batch in self._reinflate(work.running(), watermark):
                work.moves[st.request_id] = batch
                work.set_blocks[st.request_id] = [b.block_id for b in self.blocks_of(st.request_id)]
        if self.mode == "naive":
            for p, st in work.running():
                with self.isolated(st.request_id):
                    settle_ballast(st.ballast, st.table, p.next_tokens, self.bs, self.pool)
        gaps = {}
        for _, st in work.running():
            if st.gap != st.gap_sent:
                gaps[st.request_id] = st.gap_sent = st.gap
        return StepPlan(
            MoveBatch.concat(list(work.moves.values())),
            {rid: len(self.blocks_of(rid)) for rid in work.moves},
            gaps,
            MoveBatch.concat([b for _, b in work.park]),
            MoveBatch.concat([b for _, b in work.restore]),
            self.tier.drain_freed() if self.tier is not None else np.empty(0, np.int64),
            dict(work.set_blocks),
        )

    def _reinflate(self, todo, watermark: int):
        """The pool has room beyond the watermark and nothing waits: pressure-mode requests that have read their
        prompts get parked tokens back (vtoken/core/recall.py ``Recall.reinflation``), as many as the room holds
        beside every running request's next forward, so a pressure spell stops costing answers once it ends.
        Returns (request, its moves) for each."""
        keepers = [(p, st) for p, st in todo if Recall.may_reinflate(st, self.step)]
        if not keepers:
            return []
        need = sum(self.pressure.need(st, p.next_tokens) for p, st in todo)
        spare = self.pool.get_num_free_blocks() - watermark - need
        if spare <= 0:
            return []
        done = []
        for (p, st), mine in self.recall.reinflation(keepers, spare):
            with self.isolated(st.request_id):
                done.append((st, self.recall.reinflate(st, mine, p.num_output)))
        return done

    def admissible(self, waiting: Sequence[tuple[int, int, float]], watermark: int, chunk: int) -> int | None:
        """``pressure_floor``: how many of the waiting requests, in the order the engine admits them, may be
        admitted so that every request fits in the pool at its floor (vtoken/core/shedding.py admit_at_floors);
        None when neither the engine nor any request, running or waiting, has a floor (the engine admits as it
        would). ``waiting``: each one's (tokens, tokens its budget keeps of them, its floor: 0 in always mode)."""
        if not (self.floored() or any(f > 0 for _, _, f in waiting)):
            return None
        running = []
        for st in self.states.values():
            length = max(st.prefill_len, st.table.num_logical)
            running.append((length, st.keep(length), st.floor))
        return admit_at_floors(running, waiting, self.pool.num_gpu_blocks - 1, watermark, chunk, self.bs)

    def tier_admissible(self, waiting: Sequence[int]) -> int | None:
        """How many of the waiting requests, in order, the parking tier admits (vtoken/core/shedding.py
        admit_to_tier; ``waiting[i]``: its ``tier_need``), so that this tier rarely has to free the oldest parked
        tokens (``Recall.make_room``). None without a tier."""
        if self.tier is None:
            return None
        return admit_to_tier(sum(st.tier_need for st in self.states.values()), waiting, self.tier.capacity)

    def tier_need(self, policy: EvictionPolicy, max_len: int) -> int:
        """What a request may park at most (vtoken/core/shedding.py tier_need; 0 without a tier)."""
        return 0 if self.tier is None else tier_need(policy, max_len)

    def _to(self, st: RequestState, phase: Phase, why: str) -> None:
        """THE phase change of a request: checked against vtoken/core/phase.py's table, and logged."""
        check_phase(st.request_id, st.phase, phase, why)
        logger.debug("vtoken: request %s %s -> %s (%s)", st.request_id, st.phase, phase, why)
        st.phase = phase

    def _evict_by_policy(self, st: RequestState, p: Progress, stats) -> MoveBatch | None:
        victims = self._decide(st, p.num_output, stats)
        if victims.size == 0:
            return None
        park = self.tier is not None and bool(st.policy.needs)
        return self.evict(st, victims, step=0 if st.in_prefill else p.num_output, park=park)[0]

    def _shed(self, todo, fresh, shortfall: int, joint: dict[str, dict]):
        """Pressure mode: requests still keeping every token give back what the shortfall needs, with the fewest
        tokens (vtoken/core/pressure.py finds who may, vtoken/core/shedding.py plans how much: the order and why),
        each its lowest-scored candidates and never below its budget; a request still reading its prompt parks
        what it sheds. A request in ``joint`` (request -> its statistics) chooses among live and parked tokens this
        step: its choice keeps that many fewer live tokens, the losers parked. Yields (request, its moves)."""
        found = []
        for p, st in todo:
            with self.isolated(st.request_id):
                candidate = self.pressure.candidate(st, p, fresh[st.request_id], self.step)
                if candidate is not None:
                    found.append(candidate)
        for (_, p, st, ranked, _), count in zip(found, self.pressure.plan(found, shortfall)):
            if not count:
                continue
            batch = None
            with self.isolated(st.request_id):
                if st.record.shed_at < 0:
                    st.record.shed_at = st.record.forwards
                st.record.shed_tokens += int(count)
                logger.debug("vtoken: request %s sheds %d tokens (the pool is %d blocks short)", st.request_id,
                             count, shortfall)  # fmt: skip
                if st.request_id in joint:
                    batch = self._choose_now(st, p, joint[st.request_id], shed=int(count))
                if st.compacted_at != self.step:  # not chosen (no parked statistics after all): its lowest-scored
                    park = self.tier is not None and bool(st.policy.needs)
                    victims = np.sort(ranked[:count])
                    batch = self.evict(st, victims, step=0 if st.in_prefill else p.num_output, park=park)[0]
            if batch is not None:
                yield st, batch

    def _sync(self, st: RequestState, num_computed: int) -> None:
        """The table catches up with the tokens computed so far; the phase follows the prompt's progress."""
        new = num_computed - st.table.num_logical
        if new < 0:
            raise CompactorError(
                f"request {st.request_id} has {num_computed} computed tokens but its TokenTable holds "
                f"{st.table.num_logical}: state diverged"
            )
        if new:
            st.table.append(new)
        n = st.table.num_logical
        if (
            st.phase in (Phase.READING, Phase.KEEPING)
            and not st.chose
            and st.schedule.chooses(parked_while_reading(st), n, st.prefill_len)
        ):
            self._to(st, Phase.CHOOSING, f"the question read ({n} of {st.prefill_len}), {st.parked.size} parked")
        elif st.phase is Phase.READING and n >= st.prefill_len:
            self._to(st, Phase.DECODING, f"its prompt read ({n} tokens)")

    def _decide(self, st: RequestState, num_output: int, stats: dict[str, np.ndarray] | None) -> np.ndarray:
        excess = st.table.num_live - st.keep(st.table.num_logical)
        step = st.schedule.decision_step(st.table.num_logical, st.prefill_len, num_output, excess)
        if step is None or (st.policy.needs and stats is None):
            return np.empty(0, dtype=np.int64)
        return st.policy.select(self._input(st, step, stats))

    def _input(self, st: RequestState, step: int, stats: dict[str, np.ndarray] | None) -> PolicyInput:
        """What the policy sees of a request: its live tokens and their statistics, at policy step ``step``."""
        live = st.table.live_logical()
        named = {}
        if st.policy.needs:
            slots = st.table.slot_of[live]
            named = {name: stats[name][slots] for name in st.policy.needs}
        protected = protected_tokens(st.table, live, self.blocks_of(st.request_id), self.bs)
        return PolicyInput(st.table.num_logical, step, live, named, protected, st.record.seed)

    def evict(self, st: RequestState, victims: np.ndarray, step: int = 0, park: bool = False) -> tuple[MoveBatch, int]:
        """Kill ``victims`` (logical positions), pack the survivors, shrink the block list, free what emptied.
        Returns the moves (global slots) and the blocks the request keeps. Used by ``plan_step``, and directly by
        tests that choose victims themselves. ``park``: victims go to the tier while it has room (their pool
        slots are read before this step's moves), the rest die."""
        return self._compact(st, victims, step, park)

    def _compact(
        self, st: RequestState, victims: np.ndarray, step: int, park: bool, restore: Restore | None = None
    ) -> tuple[MoveBatch, int]:
        """The one kill-park-pack-restore of a request in a step. ``park``: victims go to the tier (the oldest
        parked tokens of any request make room when it is full, ``Recall.take``; what still does not fit dies).
        ``restore``: parked tokens coming back (already taken out of ``st.parked``), into the slots right after
        the packed survivors: the request's blocks must hold them (``Recall.reinflate`` adds blocks first)."""
        if st.compacted_at == self.step:
            raise CompactorError(f"request {st.request_id} compacted twice in step {self.step}")
        st.compacted_at = self.step
        blocks = self.blocks_of(st.request_id)
        ids = [b.block_id for b in blocks]
        if restore is not None:  # their tier slots are free again: the worker fetches them before any park lands
            self.tier.give(restore.tier)
        packed = kill_and_pack(st.table, victims, ids, self.bs, protected_blocks(blocks))
        holes, plan = packed.holes, packed.plan
        tier = self.recall.take(len(victims), self.step) if park and len(victims) else np.empty(0, np.int64)
        if tier.size:  # parked: hidden from the next forward on, kept in the tier
            st.parked.add(victims[: tier.size], tier, st.record.forwards, self.step, step)
            self._work.park.append((st.request_id, MoveBatch(to_global_slots(holes[: tier.size], ids, self.bs), tier)))
            self.totals.tokens_parked += int(tier.size)
        st.record.record_deaths(victims[tier.size :], step)
        self.totals.tokens_evicted += len(victims) - int(tier.size)
        st.dirty = True
        # A block that lost or gained tokens must never be offered as a prefix-cache hit again
        # (vLLM: BlockPool.evict_blocks drops the hash and keeps the block).
        touched = np.unique(np.concatenate([holes, plan.src, plan.dst]) // self.bs)
        self.pool.evict_blocks({ids[i] for i in touched.tolist()})
        kept = plan.keep_blocks
        if restore is not None and restore.logical.size:  # back right after the packed survivors
            slots = np.arange(plan.physical_len, plan.physical_len + restore.logical.size)
            st.table.revive(restore.logical, slots)
            self._work.restore.append((st.request_id, MoveBatch(restore.tier, to_global_slots(slots, ids, self.bs))))
            st.record.record_restored(restore.logical, restore.at_forward)
            self.totals.tokens_restored += int(restore.logical.size)
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

    def _choose_now(self, st: RequestState, p: Progress, stats, shed: int = 0) -> MoveBatch | None:
        """A request's choice among live and parked tokens this step: with the question, or a recall."""
        if st.phase is Phase.CHOOSING:
            return self._choose_with_parked(st, stats, shed)
        return self.recall.while_decoding(st, stats, p.num_output, shed)

    def _choose_with_parked(self, st: RequestState, stats: dict[str, np.ndarray] | None, shed: int = 0):
        """The decision of a ``choosing`` request: its live and parked tokens chosen by the last chunk's window
        over both (``Recall.choose``), then back to reading, decoding or keeping. ``shed``: pressure mode's share
        of a shortfall, given up in the same choice."""
        keep = st.table.num_live - shed if st.schedule.eager else None  # pressure mode keeps as many as it holds
        batch = self.recall.choose(st, stats, keep, step=0)
        self._chosen(st)
        return batch

    def _chosen(self, st: RequestState) -> None:
        st.chose = True  # once a run: later its parked tokens come back by recall (decoding) or re-inflation
        if st.schedule.eager:  # pressure mode: back to keeping every token until the pool runs short
            phase = Phase.KEEPING
        else:
            phase = Phase.READING if st.in_prefill else Phase.DECODING
        self._to(st, phase, "live and parked tokens chosen with the question")

    # ---------------------------------------------------------------- after vLLM scheduled
    def stop_short(self, request_id: str, new_tokens: int, num_computed_after: int) -> bool:
        """Should this forward stop one token before the end of the prompt (Schedule.stops_short)?"""
        st = self.states.get(request_id)
        return bool(st and st.schedule.stops_short(st.parked.size > 0, new_tokens, num_computed_after, st.prefill_len))

    def scheduled(self, request_id: str, new_tokens: int, num_computed_after: int, num_output: int) -> ScoreAsk | None:
        """A forward of ``new_tokens`` tokens runs this step (vLLM already counted them as computed and allocated
        their blocks). Records it and returns what the worker should score, or None (vtoken/core/score_ask.py)."""
        st = self.states[request_id]
        before = num_computed_after - new_tokens
        prefill = before < st.prefill_len
        self._sync(st, before)  # a prefix-cache hit at admission: those tokens' KV exists already
        table = st.table
        live = table.num_live
        held = len(self.blocks_of(request_id)) + len(st.ballast)
        naive = table.naive_blocks(new_tokens)
        p, sched = st.policy, st.schedule
        slack = 0 if prefill else sched.slack - 1  # a decoding request holds up to slack - 1 tokens above its keep
        bound = forward_bound(before, new_tokens, self.bs, p.budget, p.sink, p.recent, slack)
        st.record.forward(new_tokens, prefill, held, naive, -(-(live + new_tokens) // self.bs), bound)
        return score_ask(st, new_tokens, num_computed_after, num_output, prefill)

    def foresee(
        self, scheduled: dict[str, int], waiting: Sequence[int], watermark: int, chunk: int, lead: int
    ) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        """Pressure mode, after vLLM scheduled this step: may the pool run short soon? Returns the keeping decoders
        whose query this forward adds to their window, and those whose window is scored after it, with the
        statistics to send back (vtoken/core/pressure.py ``Pressure.foresee``)."""
        return self.pressure.foresee(scheduled, waiting, watermark, chunk, lead)

    # ---------------------------------------------------------------- observability
    def check_integrity(self, moves: MoveBatch | None = None) -> None:
        """Blocks against TokenTables, ballast disjoint from every block list, parked tokens only where a phase
        has them, a step's moves well formed."""
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
