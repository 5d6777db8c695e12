"""VTokenScheduler: vLLM's scheduler with vToken's compactor (vtoken/core/compactor.py) wired in. vLLM glue only.

Each step:

  1. BEFORE vLLM schedules (so freed blocks can be handed out in this same step): the compactor syncs every
     running request's TokenTable with ``request.num_computed_tokens``, lets the policy evict (at a prefill
     chunk boundary or a decode step), packs the survivors and returns the emptied blocks to vLLM's BlockPool
     (naive mode keeps Naive-Evict's share as ballast);
  2. vLLM schedules; blocks are sized by each request's PHYSICAL length (logical minus its gap);
  3. AFTER: the compactor records each scheduled forward and says which queries the worker scores; one
     ``VTokenStep`` (all moves, block truncations, gap changes, scoring asks) rides on the SchedulerOutput
     and the worker applies it before this step's forward.

vLLM keeps counting LOGICAL tokens (``num_computed_tokens``), so RoPE positions and sampling are untouched.
Everything here touches vLLM 0.32.0 private internals; each override names what it mirrors.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from vtoken.config import CONFIG_KEY, RequestConfigs, VTokenConfig
from vtoken.core.budget import kept_tokens
from vtoken.core.compactor import Compactor
from vtoken.core.park import TierSlots
from vtoken.core.step import Progress, StepPlan
from vtoken.pool_report import PoolReport
from vtoken.vllm_adapter.engine import tier_tokens
from vtoken.vllm_adapter.messages import VTokenStep, VTokenWorkerOutput

logger = logging.getLogger(__name__)


class VTokenScheduler(Scheduler):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # The workers run vLLM's V1 runner (worker.py _force_v1_runner); Scheduler.__init__ copied the V2 choice
        # from VllmConfig, and with it would send a resumed request as a new one (Scheduler._make_cached_request
        # _data). Mirror of vllm/v1/core/sched/scheduler.py Scheduler.__init__ use_v2_model_runner.
        self.use_v2_model_runner = False
        self.vt = VTokenConfig.from_vllm(vllm_config)
        self.vt_policies = RequestConfigs(self.vt)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or type(managers[0]).__name__ != "FullAttentionManager":
            raise ValueError(
                "vToken supports models with one full-attention KV cache group; this model has "
                f"{[type(m).__name__ for m in managers]}"
            )
        self.vt_manager = managers[0]
        self.vt_pool = self.kv_cache_manager.block_pool
        self.vt_bs = self.vt_manager.block_size
        # vllm/v1/core/single_type_kv_cache_manager.py: req_to_blocks[rid] is the request's block list.
        device = vllm_config.device_config.device_type  # the worker sizes its tier alike
        park = tier_tokens(self.vt, vllm_config, kv_cache_config, device)
        tier = TierSlots(park) if park else None
        self.vt_core = Compactor(
            self.vt.mode,
            self.vt_bs,
            self.vt_pool,
            lambda rid: self.vt_manager.req_to_blocks[rid],
            tier,
            trace=bool(self.vt.trace_path),
            floor=self.vt.pressure_floor,  # for the requests in pressure mode (the engine's default or their own)
        )
        sc = vllm_config.scheduler_config
        self.vt_chunk = sc.long_prefill_token_threshold or sc.max_num_batched_tokens
        self.vt_max_seqs = sc.max_num_seqs
        self.vt_watermark = math.ceil(self.vt.pressure_watermark * (self.vt_pool.num_gpu_blocks - 1))
        self.vt_trace = open(self.vt.trace_path, "a") if self.vt.trace_path else None  # noqa: SIM115 - engine life
        self.vt_ended: list[tuple[int, EngineCoreOutput]] = []  # failed requests' last outputs, for their clients
        self._wrap_coordinator()
        install_engine_core_utilities()

    # ---------------------------------------------------------------- allocation by physical length
    def _wrap_coordinator(self) -> None:
        """Mirror of vllm/v1/core/kv_cache_coordinator.py KVCacheCoordinator.get_num_blocks_to_allocate and
        allocate_new_blocks: both size a request by its token count; we pass the physical count instead."""
        coord = self.kv_cache_manager.coordinator
        orig_count, orig_alloc = coord.get_num_blocks_to_allocate, coord.allocate_new_blocks
        orig_cache = coord.cache_blocks

        core = self.vt_core

        def get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs):
            gap = core.gap(request_id)
            if gap and "num_tokens_main_model" in kwargs:
                kwargs["num_tokens_main_model"] -= gap
            return orig_count(request_id, num_tokens - gap, *args, **kwargs)

        def allocate_new_blocks(request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
            gap = core.gap(request_id)
            return orig_alloc(request_id, num_tokens - gap, num_tokens_main_model - gap, *args, **kwargs)

        def cache_blocks(request, num_computed_tokens):
            """Mirror of KVCacheCoordinator.cache_blocks: it hashes block i as logical tokens [i*B, (i+1)*B);
            once a request lost a token that no longer describes its blocks, so it is never cached again."""
            if core.may_cache(request.request_id):
                orig_cache(request, num_computed_tokens)

        coord.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        coord.allocate_new_blocks = allocate_new_blocks
        coord.cache_blocks = cache_blocks

    # ---------------------------------------------------------------- the step
    def schedule(self, *args, **kwargs):
        """Mirror of vllm/v1/core/sched/scheduler.py Scheduler.schedule: evict and compact first, then record
        what vLLM scheduled."""
        t0 = time.perf_counter()
        core = self.vt_core
        waiting, limit = self._waiting()
        plan = self._vt_before_schedule(core.plan_step(self._progress(), waiting, self.vt_watermark))
        self._vt_end_failed()  # before vLLM schedules: a request whose decision raised is not scheduled again
        cached = self.vt_manager.num_cached_block  # blocks of each request already hashed into the prefix cache
        for rid, keep in plan.keep_blocks.items():
            if rid in cached:
                cached[rid] = min(cached[rid], keep)
        t1 = time.perf_counter()
        if limit is not None:  # again, on the tables plan_step brought up to date
            limit = self._admission_limit(self._next_admitted())
        active = self.max_num_active_reqs
        if limit is not None:  # pressure_floor: the rest wait (vLLM's own cap on admission, for this call only)
            self.max_num_active_reqs = min(active, len(self.running) + self.num_waiting_for_streaming_input + limit)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs = active
        t2 = time.perf_counter()
        step = VTokenStep(plan.moves, plan.keep_blocks, plan.gaps, park=plan.park, restore=plan.restore,
                          tier_freed=plan.tier_freed, set_blocks=plan.set_blocks)  # fmt: skip
        record: list[str] = []
        for rid, n in list(out.num_scheduled_tokens.items()):
            request = self.requests[rid]
            with core.isolated(rid):
                if not core.tracks(rid):
                    self._admit(request, n)
                elif core.stop_short(rid, n, request.num_computed_tokens):
                    n = self._stop_one_short(out, request)
                ask = core.scheduled(rid, n, request.num_computed_tokens, request.num_output_tokens)
                if ask is not None:
                    if ask.queries:
                        step.observe[rid] = ask.queries
                    if ask.export:
                        step.export[rid] = ask.export
                    if ask.parked is not None:
                        step.joint[rid] = ask.parked
                    if ask.record:
                        record.append(rid)
                    if ask.window:
                        step.window[rid] = ask.window
                    if ask.window_parked is not None:
                        step.window_parked[rid] = ask.window_parked
        # A request that failed here was scheduled already: it ends now, as one aborted while the step runs (its
        # forward runs on the blocks it held; they go to other requests from the next step on).
        self._vt_end_failed()
        if core.pressure_active():  # scores on demand for a shed the next steps may need (Compactor.foresee)
            try:
                more, score = core.foresee(out.num_scheduled_tokens, self._waiting()[0], self.vt_watermark,
                                           self.vt_chunk, self.vt.decode_window)  # fmt: skip
            except Exception:  # noqa: BLE001 - a forecast, not a decision: without it a shed judges older scores
                logger.exception("vtoken: the forecast of the pool failed; this step scores no windows")
                more, score = [], {}
            record += more  # keepers: scheduled() asked nothing of them (it records and scores decoding requests)
            step.window.update(score)
        step.record = tuple(record)
        core.note_step(len(self.running), (t1 - t0) + (time.perf_counter() - t2))
        out.vtoken = step
        return out

    def _stop_one_short(self, out, request) -> int:
        """This step's forward of ``request`` stops one token before the end of its prompt (compactor.stop_short);
        vLLM then reads the last prompt token, and samples, in the next step. Undoes one token of
        vllm/v1/core/sched/scheduler.py Scheduler._update_after_schedule (num_computed_tokens,
        num_in_flight_tokens, is_prefill_chunk, _inflight_prefills) and of the step's token counts; the worker
        then discards this forward's sample as for any partial prefill (GPUModelRunner discard_request_mask)."""
        rid = request.request_id
        out.num_scheduled_tokens[rid] -= 1
        out.total_num_scheduled_tokens -= 1
        request.num_computed_tokens -= 1
        request.num_in_flight_tokens -= 1
        request.is_prefill_chunk = True
        self._inflight_prefills.add(request)
        return out.num_scheduled_tokens[rid]

    def _vt_before_schedule(self, plan: StepPlan) -> StepPlan:
        """Hook between the compaction plan and vLLM's scheduling (the testing scheduler relocates here)."""
        return plan

    def _waiting(self) -> tuple[list[int], int | None]:
        """Pressure mode: the tokens the first forward of each waiting request reads, as many as max_num_seqs lets
        run and pressure_floor admits (empty when no request is in pressure mode: the compactor's rule then sheds
        nothing), and how many of the next waiting requests pressure_floor admits (None: as vLLM would). Mirrors
        what vllm/v1/core/sched/scheduler.py Scheduler.schedule asks of the pool: running requests first, then
        waiting ones."""
        pressure = self.vt_core.pressure_active()
        if not (pressure or self.waiting):
            return [], None
        nxt = self._next_admitted()
        limit = self._admission_limit(nxt)
        if not pressure:
            return [], limit
        found = [min(r.num_tokens - r.num_computed_tokens, self.vt_chunk) for r in nxt]
        return (found if limit is None else found[:limit]), limit

    def _next_admitted(self) -> list:
        """The waiting requests vLLM would admit next, in order, as many as max_num_seqs lets run."""
        return list(itertools.islice(self.waiting, max(self.vt_max_seqs - len(self.running), 0)))

    def _admission_limit(self, nxt: list) -> int | None:
        """How many of ``nxt`` (``_next_admitted()``) may be admitted: so that the parking tier holds what every
        request may park (Compactor.tier_admissible), and, with a pressure_floor, so that every request fits in the
        pool at its floor, the engine's or its own (Compactor.admissible); None when neither limits. vLLM's
        Scheduler.schedule admits a waiting request whenever the pool holds its first chunk; this caps how many it
        may admit in this step."""
        core = self.vt_core
        if not nxt:
            return None
        found = [self._policy_for(r) for r in nxt]
        tier = core.tier_admissible([core.tier_need(policy, r.num_prompt_tokens + r.max_tokens)
                                     for r, (policy, _) in zip(nxt, found)])  # fmt: skip
        if not (core.floored() or any(map(_asks_floor, nxt))):
            return tier
        waiting = []
        for r, (policy, opts) in zip(nxt, found):
            n = r.num_tokens
            keep = kept_tokens(n, policy.budget, policy.sink, policy.recent) if policy is not None else n
            waiting.append((n, keep, opts.pressure_floor if opts.evict == "pressure" else 0.0))
        floor = core.admissible(waiting, self.vt_watermark, self.vt_chunk)
        return min((n for n in (floor, tier) if n is not None), default=None)  # None: that rule does not limit

    def _progress(self) -> list[Progress]:
        core, chunk = self.vt_core, self.vt_chunk
        found = (core.progress(r.request_id, r.num_computed_tokens, r.num_output_tokens, chunk) for r in self.running)
        return [p for p in found if p is not None]

    def _admit(self, request, new_tokens: int) -> None:
        """A request's first forward (new, or resumed after a preemption: it recomputes every token it had, prompt
        and outputs, before it samples again): give it its state."""
        policy, opts = self._policy_for(request)
        self.vt_core.admit(
            request.request_id,
            external_id(request.request_id),
            policy,
            prefill_len=request.num_tokens,
            prefill_evict=opts.prefill_evict,
            window=opts.prefill_window,
            pressure=opts.evict == "pressure",
            prefix_cached=request.num_computed_tokens - new_tokens,
            outputs_at_start=request.num_output_tokens,
            logprobs=getattr(request.sampling_params, "logprobs", None) is not None,
            floor=opts.pressure_floor,
            recall_every=opts.recall_every,
            max_len=request.num_prompt_tokens + request.max_tokens,
        )

    def _policy_for(self, request):
        """The request's own options (``SamplingParams.extra_args["vtoken"]``, see config.request_args) or the
        engine's, and the policy they make (config.RequestConfigs: cached, bounded, never raises)."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        return self.vt_policies.get(extra.get(CONFIG_KEY) if isinstance(extra, dict) else None, request.request_id)

    # ---------------------------------------------------------------- worker output, request end
    def update_from_output(self, scheduler_output, model_runner_output):
        """Mirror of Scheduler.update_from_output: first collect the worker's attention statistics and, for
        requests that asked for logprobs, the sampled tokens' log-probabilities (for the trace)."""
        vt: VTokenWorkerOutput | None = getattr(model_runner_output, "vtoken", None)
        core = self.vt_core
        if vt is not None:
            for rid, stats in vt.stats.items():
                with core.isolated(rid):
                    core.receive_stats(rid, stats)
            core.note_worker(vt.move_seconds, vt.bytes_moved, score_seconds=vt.score_seconds,
                             recall_bytes=vt.recall_bytes, recall_seconds=vt.recall_seconds)  # fmt: skip
        lp = getattr(model_runner_output, "logprobs", None)
        if lp is not None and self.vt_trace is not None:
            sampled = model_runner_output.sampled_token_ids
            for i, rid in enumerate(model_runner_output.req_ids):
                if len(sampled[i]) and core.wants_logprobs(rid):
                    with core.isolated(rid):
                        # LogprobsLists rows: column 0 is the sampled token (vllm/v1/outputs.py)
                        core.add_logprobs(rid, lp.slice_request(i, len(sampled[i])).logprobs[:, 0].tolist())
        self._vt_end_failed()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for client, last in self.vt_ended:
            eco = outputs.get(client)
            if eco is None:
                outputs[client] = eco = EngineCoreOutputs()
            eco.outputs = [*eco.outputs, last]
        self.vt_ended = []
        return outputs

    def _vt_end_failed(self) -> None:
        """The requests vToken failed to decide for (Compactor.isolated) end alone, with an error: mirror of the
        error path of vllm/v1/core/sched/scheduler.py Scheduler.update_from_output (error_req_ids): finish_requests
        with FINISHED_ERROR (finish reason "error", which vLLM's server answers with a 500), which frees their
        blocks now, and a last EngineCoreOutput for each client, sent with this step's outputs."""
        failed = self.vt_core.take_failed()
        if not failed:
            return
        for request in self.finish_requests(failed, RequestStatus.FINISHED_ERROR):
            logger.error("vtoken: request %s ended with an error (%s); the engine serves on",
                         external_id(request.request_id), failed[request.request_id])  # fmt: skip
            last = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            self.vt_ended.append((request.client_index, last))

    def _free_request_blocks(self, request) -> None:
        """Mirror of Scheduler._free_request_blocks (finish and preemption): the compactor forgets the request
        and returns its ballast, and hands back a finished request's trace line. Preemption recomputes every
        logical token, so a resumed request starts over (the compactor keeps the earlier run for its trace)."""
        finished = request.is_finished()
        line = self.vt_core.remove(
            request.request_id,
            finished,
            (request.prompt_token_ids or []) if finished else (),
            request.output_token_ids if finished else (),
        )
        if line is not None and self.vt_trace is not None:
            self.vt_trace.write(json.dumps(line) + "\n")
            self.vt_trace.flush()
        super()._free_request_blocks(request)

    # ---------------------------------------------------------------- observability
    def vtoken_stats(self, reset: bool = False) -> dict[str, Any]:
        """Per-request and per-engine figures (see vtoken/core/records.py). Walks every running request: for tests and
        benchmarks; servers poll ``vtoken_pool_report``. ``reset``: afterwards start peak_running and the
        finished-request list afresh."""
        core = self.vt_core.stats(reset, running=len(self.running))
        return {
            "mode": self.vt.mode,
            "policy": self.vt.policy,
            "block_size": self.vt_bs,
            "free_blocks": self.vt_pool.get_num_free_blocks(),
            "total_blocks": self.vt_pool.num_gpu_blocks - 1,
            "kv_cache_usage": self.vt_pool.get_usage(),
            "running": len(self.running),
            "waiting": len(self.waiting),
            **core,
        }

    def vtoken_pool_report(self) -> PoolReport:
        """The pool in a few numbers (messages.PoolReport), for replicas' frequent reports: O(requests + blocks)."""
        r = self.vt_core.report()
        return PoolReport(
            free_blocks=self.vt_pool.get_num_free_blocks(),
            total_blocks=self.vt_pool.num_gpu_blocks - 1,
            kv_cache_usage=self.vt_pool.get_usage(),
            running=len(self.running),
            waiting=len(self.waiting),
            live_tokens=r.live_tokens,
            retained_blocks=r.retained_blocks,
            naive_retained_blocks=r.naive_retained_blocks,
            blocks_reclaimed=max(r.naive_retained_blocks - r.retained_blocks, 0),
            admitted=r.admitted,
            blocks_freed_total=r.blocks_freed,
            tokens_evicted_total=r.tokens_evicted,
            tokens_moved_total=r.tokens_moved,
            compaction_seconds_total=r.compaction_seconds,
            preemptions_total=r.preemptions,
            block_size=self.vt_bs,
            tokens_to_go=tokens_to_go(self.running),
            parked_tokens=r.parked_tokens,
            tier_tokens=r.tier_tokens,
            tokens_recalled_total=r.tokens_recalled,
            recalls_total=r.recalls,
            recall_bytes_total=r.recall_bytes,
        )

    def vtoken_check_integrity(self) -> bool:
        """Testing and debugging: the compactor's invariants against vLLM's block lists (raises on a breach)."""
        self.vt_core.check_integrity()
        return True


def _asks_floor(request) -> bool:
    """The request sets its own pressure_floor (``SamplingParams.extra_args["vtoken"]``)."""
    extra = getattr(request.sampling_params, "extra_args", None)
    opts = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    return isinstance(opts, dict) and "pressure_floor" in opts


def tokens_to_go(requests) -> int:
    """What ``requests`` (vllm/v1/request.py Request) have still to read of their prompts and to generate,
    up to their max_tokens: O(requests) integer sums."""
    return sum(
        max(r.num_prompt_tokens - r.num_computed_tokens, 0) + max(r.max_tokens - r.num_output_tokens, 0)
        for r in requests
    )


def external_id(rid: str) -> str:
    """The caller's request id: vllm/v1/engine/input_processor.py InputProcessor.assign_request_id appends
    "-" and 8 characters of a random uuid. Randomised policies seed from the caller's id, so that reruns, naive
    and vtoken, and every TP rank reach the same decisions; records and traces carry it."""
    head, _, tail = rid.rpartition("-")
    return head if head and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail) else rid


UTILITIES = ("vtoken_stats", "vtoken_pool_report", "vtoken_check_integrity")


def install_engine_core_utilities() -> None:
    """Make the scheduler's ``vtoken_*`` methods callable through vLLM's utility RPC (vllm/v1/engine/core.py
    EngineCore._handle_client_request looks a utility up with getattr on the EngineCore). Called when a
    VTokenScheduler is built, in the EngineCore's own process, never on import."""
    from vllm.v1.engine.core import EngineCore

    for name in UTILITIES:
        if hasattr(EngineCore, name):
            continue

        def utility(self, *args, _name=name):
            fn = getattr(self.scheduler, _name, None)
            if fn is None:
                raise RuntimeError(f"{_name}: this engine runs without vToken (mode off)")
            return fn(*args)

        setattr(EngineCore, name, utility)
