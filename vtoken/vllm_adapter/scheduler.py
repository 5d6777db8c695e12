"""VTokenScheduler: vLLM's scheduler, plus a TokenTable per request, an eviction policy and compaction.

Each step, BEFORE vLLM schedules (so freed blocks can be handed out in the same step):

  1. sync every running decode request's TokenTable with ``request.num_computed_tokens``;
  2. ask the policy which logical tokens die (with the attention statistics the worker sent back);
  3. plan the compaction and shrink the request's block list; the freed blocks go straight back to
     vLLM's BlockPool, so ``kv_cache_usage`` and admission see them (naive mode keeps some as ballast);
  4. attach one ``VTokenStep`` (all moves of all requests, block truncations, gap changes) to the
     SchedulerOutput; the worker applies it before this step's forward.

vLLM keeps counting LOGICAL tokens (``num_computed_tokens``), so RoPE positions and sampling are untouched;
only the KV allocation is made physical, by subtracting each request's gap (logical - physical length) in
the two coordinator calls that size a request's blocks.

Everything here touches vLLM private internals of 0.32.0 only; each override names what it mirrors.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler

from vtoken.accounting import floor_blocks, naive_retained_blocks
from vtoken.mover import MoveBatch
from vtoken.planner import plan_compaction, protected_prefix, to_global_slots
from vtoken.policies import PolicyInput
from vtoken.replay import request_seed
from vtoken.token_table import TokenTable
from vtoken.vllm_adapter.config import CONFIG_KEY, VTokenConfig
from vtoken.vllm_adapter.messages import PoolReport, VTokenStep, VTokenWorkerOutput
from vtoken.vllm_adapter.stats import EngineTotals, RequestRecord

logger = logging.getLogger(__name__)


class VTokenScheduler(Scheduler):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.vt = VTokenConfig.from_vllm(vllm_config)
        self.vt_policy = self.vt.make_policy()
        self.vt_policies: dict[str, Any] = {"": self.vt_policy}  # request options (JSON) -> policy
        self.vt_req_policy: dict[str, Any] = {}
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or type(managers[0]).__name__ != "FullAttentionManager":
            raise ValueError(
                "vToken supports models with one full-attention KV cache group; this model has "
                f"{[type(m).__name__ for m in managers]}"
            )
        self.vt_manager = managers[0]
        self.vt_pool = self.kv_cache_manager.block_pool
        self.vt_bs = self.vt_manager.block_size
        self.vt_tables: dict[str, TokenTable] = {}
        self.vt_records: dict[str, RequestRecord] = {}
        self.vt_ballast: dict[str, list] = {}  # naive mode: blocks held as Naive-Evict would
        self.vt_stats_in: dict[str, dict[str, np.ndarray]] = {}
        self.vt_gap_sent: dict[str, int] = {}
        self.vt_dirty: set[str] = set()  # requests that lost tokens: never prefix-cached again
        self.vt_totals = EngineTotals()
        self._wrap_coordinator()
        install_engine_core_utilities()

    # ---------------------------------------------------------------- allocation by physical length
    def _gap(self, request_id: str) -> int:
        t = self.vt_tables.get(request_id)
        return 0 if t is None else t.num_logical - t.physical_len

    def _wrap_coordinator(self) -> None:
        """Mirror of vllm/v1/core/kv_cache_coordinator.py KVCacheCoordinator.get_num_blocks_to_allocate and
        allocate_new_blocks: both size a request by its token count; we pass the physical count instead."""
        coord = self.kv_cache_manager.coordinator
        orig_count, orig_alloc = coord.get_num_blocks_to_allocate, coord.allocate_new_blocks

        def get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs):
            gap = self._gap(request_id)
            if gap and "num_tokens_main_model" in kwargs:
                kwargs["num_tokens_main_model"] -= gap
            return orig_count(request_id, num_tokens - gap, *args, **kwargs)

        def allocate_new_blocks(request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
            gap = self._gap(request_id)
            return orig_alloc(request_id, num_tokens - gap, num_tokens_main_model - gap, *args, **kwargs)

        orig_cache = coord.cache_blocks

        def cache_blocks(request, num_computed_tokens):
            """Mirror of KVCacheCoordinator.cache_blocks: it hashes block i as logical tokens [i*B, (i+1)*B);
            once a request lost a token that no longer describes its blocks, so it is never cached again."""
            if request.request_id not in self.vt_dirty:
                orig_cache(request, num_computed_tokens)

        coord.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        coord.allocate_new_blocks = allocate_new_blocks
        coord.cache_blocks = cache_blocks

    # ---------------------------------------------------------------- the step
    def schedule(self, *args, **kwargs):
        """Mirror of vllm/v1/core/sched/scheduler.py Scheduler.schedule: evict and compact first."""
        t0 = time.perf_counter()
        step = self._evict_and_compact()
        self.vt_totals.compaction_seconds += time.perf_counter() - t0
        out = super().schedule(*args, **kwargs)
        out.vtoken = step
        return out

    def _evict_and_compact(self) -> VTokenStep:
        moves, keep, gaps, want, relocate = [], {}, {}, {}, {}
        for request in self.running:
            rid = request.request_id
            table = self.vt_tables.get(rid)
            if table is None:
                table = self.vt_tables[rid] = TokenTable(self.vt_bs)
                p = self._policy_for(request)
                ext = external_id(rid)
                self.vt_records[rid] = RequestRecord(ext, request_seed(ext), policy=p.name, budget=p.budget)
            policy = self.vt_req_policy[rid]
            new = request.num_computed_tokens - table.num_logical
            if new < 0:
                raise RuntimeError(
                    f"vtoken: request {rid} has {request.num_computed_tokens} computed tokens but "
                    f"its TokenTable holds {table.num_logical}: state diverged"
                )
            table.append(new)
            decoding = request.num_computed_tokens >= request.num_prompt_tokens and request.num_output_tokens > 0
            if not decoding:
                continue
            step = request.num_output_tokens
            stats = self.vt_stats_in.pop(rid, None)
            if (step + 1) % policy.interval == 0 and policy.needs:
                want[rid] = policy.needs
            if self.vt.relocate_every and step % self.vt.relocate_every == 0:
                # alone in its step: compaction moves computed against the new blocks would otherwise be
                # gathered before the relocation wrote them
                moves.append(self._relocate(rid, table, relocate))
                continue
            if policy.needs and (stats is None or step % policy.interval):
                continue
            victims = self._select(table, step, stats, rid, policy)
            if victims.size == 0:
                continue
            holes = table.kill(victims)
            self.vt_totals.tokens_evicted += victims.size
            self.vt_records[rid].record_deaths(victims, step)
            self.vt_dirty.add(rid)
            batch, n_keep = self._compact(rid, table, holes)
            moves.append(batch)
            keep[rid] = n_keep
            gap = table.num_logical - table.physical_len
            if self.vt_gap_sent.get(rid, 0) != gap:
                gaps[rid] = self.vt_gap_sent[rid] = gap
        if self.vt.mode == "naive":
            self._settle_ballast()
        self._observe()
        batch = MoveBatch.concat(moves)
        self.vt_totals.tokens_moved += len(batch)
        return VTokenStep(batch, keep, gaps, want, relocate)

    def _policy_for(self, request):
        """The request's own policy (``SamplingParams.extra_args["vtoken"]``, see config.request_args) or
        the engine's. Clients validate with request_args; an option this engine cannot honour is logged and
        the engine's policy used, because an exception here would stop the engine for every request."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        options = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        key = json.dumps(options, sort_keys=True) if options else ""
        policy = self.vt_policies.get(key)
        if policy is None:
            try:
                policy = self.vt.for_request(options).make_policy()
            except (ValueError, TypeError) as e:
                logger.error("vtoken: request %s: %s; using the engine's policy", request.request_id, e)
                policy = self.vt_policy
            self.vt_policies[key] = policy
        self.vt_req_policy[request.request_id] = policy
        return policy

    def _select(self, table: TokenTable, step: int, stats, rid: str, policy) -> np.ndarray:
        live = table.live_logical()
        named = {}
        if stats:
            slots = table.slot_of[live]
            named = {name: stats[name][slots] for name in policy.needs}
        inp = PolicyInput(
            table.num_logical, step, live, named, self._protected(rid, table, live), self.vt_records[rid].seed
        )
        return policy.select(inp)

    def _shared_blocks(self, rid: str) -> np.ndarray:
        """Which of the request's blocks other requests also hold (ref_cnt > 1), e.g. a cached prefix."""
        return np.array([b.ref_cnt > 1 for b in self.vt_manager.req_to_blocks.get(rid, [])], dtype=bool)

    def _protected(self, rid: str, table: TokenTable, live: np.ndarray) -> np.ndarray | None:
        """Tokens in blocks shared with another request are never evicted (the paper's rule)."""
        shared = self._shared_blocks(rid)
        if not shared.any():
            return None
        slots = table.slot_of[live]
        return shared[np.minimum(slots // self.vt_bs, shared.size - 1)]

    def _compact(self, rid: str, table: TokenTable, holes: np.ndarray) -> tuple[MoveBatch, int]:
        blocks = self.vt_manager.req_to_blocks[rid]
        ids = [b.block_id for b in blocks]
        n_protected = protected_prefix(self._shared_blocks(rid))
        plan = plan_compaction(table.physical_live_mask(), ids, self.vt_bs, n_protected)
        # A block that lost or gained tokens must never be offered as a prefix-cache hit again
        # (vllm/v1/core/block_pool.py BlockPool.evict_blocks drops the hash, keeps the block).
        touched = np.concatenate([holes, plan.src, plan.dst]) // self.vt_bs
        self.vt_pool.evict_blocks({ids[i] for i in np.unique(touched).tolist()})
        table.apply_moves(plan.src, plan.dst, plan.physical_len)
        # Blocks past the packed length are empty now; vLLM's allocate_slots adds back the block the next
        # token needs, sized by the physical length.
        freed = blocks[plan.keep_blocks :]
        del blocks[plan.keep_blocks :]
        cached = self.vt_manager.num_cached_block
        if rid in cached:
            cached[rid] = min(cached[rid], plan.keep_blocks)
        if freed:
            if self.vt.mode == "naive":
                self.vt_ballast.setdefault(rid, []).extend(freed)  # settled against Naive-Evict below
            else:
                self.vt_pool.free_blocks(reversed(freed))
                self.vt_totals.blocks_freed += len(freed)
        self.vt_records[rid].tokens_moved += plan.num_moves
        batch = MoveBatch(to_global_slots(plan.src, ids, self.vt_bs), to_global_slots(plan.dst, ids, self.vt_bs))
        return batch, plan.keep_blocks

    def _relocate(self, rid: str, table: TokenTable, relocate: dict[str, list[int]]) -> MoveBatch:
        """Testing knob: move every slot to the same slot of fresh blocks, free the old blocks."""
        old = self.vt_manager.req_to_blocks[rid]
        if len(old) > self.vt_pool.get_num_free_blocks():
            return MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64))
        new = self.vt_pool.get_new_blocks(len(old))
        slots = np.arange(table.physical_len)
        batch = MoveBatch(
            to_global_slots(slots, [b.block_id for b in old], self.vt_bs),
            to_global_slots(slots, [b.block_id for b in new], self.vt_bs),
        )
        self.vt_manager.req_to_blocks[rid] = new
        self.vt_pool.free_blocks(reversed(old))
        relocate[rid] = [b.block_id for b in new]
        return batch

    def _observe(self) -> None:
        """Per decode step: what each request holds now, and what Naive-Evict would hold."""
        self.vt_totals.peak_running = max(self.vt_totals.peak_running, len(self.running))
        for request in self.running:
            rid = request.request_id
            table = self.vt_tables.get(rid)
            if table is None or request.num_output_tokens == 0:
                continue
            held = len(self.vt_manager.req_to_blocks.get(rid, [])) + len(self.vt_ballast.get(rid, []))
            self.vt_records[rid].observe(
                held, naive_retained_blocks(table.live_mask(), self.vt_bs), floor_blocks(table.num_live, self.vt_bs)
            )

    def _settle_ballast(self) -> None:
        """Naive mode: hold exactly the blocks Naive-Evict would hold, beyond what the packed layout needs.

        Naive-Evict keeps every block with a live token at its original slot, plus the block the next token
        goes to. Extra ballast goes back to the pool; missing ballast is taken from it while it lasts.
        """
        for request in self.running:
            rid = request.request_id
            table = self.vt_tables.get(rid)
            if table is None:
                continue
            live = np.append(table.live_mask(), True)  # the token this step writes
            want = naive_retained_blocks(live, self.vt_bs) - floor_blocks(table.physical_len + 1, self.vt_bs)
            held = self.vt_ballast.setdefault(rid, [])
            if len(held) > want:
                extra = held[max(want, 0) :]
                del held[max(want, 0) :]
                self.vt_pool.free_blocks(reversed(extra))
            elif len(held) < want:
                n = min(want - len(held), self.vt_pool.get_num_free_blocks())
                if n:
                    held.extend(self.vt_pool.get_new_blocks(n))

    # ---------------------------------------------------------------- worker output, request end
    def update_from_output(self, scheduler_output, model_runner_output):
        """Mirror of Scheduler.update_from_output: also collect the worker's attention statistics."""
        vt: VTokenWorkerOutput | None = getattr(model_runner_output, "vtoken", None)
        if vt is not None:
            self.vt_stats_in.update(vt.stats)
            self.vt_totals.move_seconds += vt.move_seconds
            self.vt_totals.bytes_moved += vt.bytes_moved
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request_blocks(self, request) -> None:
        """Mirror of Scheduler._free_request_blocks (finish and preemption): drop the request's table and
        ballast too. Preemption recomputes every logical token, so the table starts over."""
        rid = request.request_id
        table = self.vt_tables.pop(rid, None)
        if table is not None:
            record = self.vt_records.pop(rid)
            if request.is_finished():
                self._finish_record(request, table, record)
            else:
                self.vt_totals.preemptions += 1
        ballast = self.vt_ballast.pop(rid, None)
        if ballast:
            self.vt_pool.free_blocks(reversed(ballast))
        self.vt_stats_in.pop(rid, None)
        self.vt_gap_sent.pop(rid, None)
        self.vt_req_policy.pop(rid, None)
        self.vt_dirty.discard(rid)  # preemption recomputes every token: cacheable again
        super()._free_request_blocks(request)

    def _finish_record(self, request, table: TokenTable, record: RequestRecord) -> None:
        record.finish(
            table,
            self.vt_manager.req_to_blocks.get(request.request_id, []),
            len(self.vt_ballast.get(request.request_id, [])),
        )
        self.vt_totals.add_finished(record)
        if self.vt.trace_path:
            line = {
                "request_id": record.request_id,
                "prompt_token_ids": list(request.prompt_token_ids or []),
                "output_token_ids": list(request.output_token_ids),
                **record.trace(),
            }
            with open(self.vt.trace_path, "a") as f:
                f.write(json.dumps(line) + "\n")

    # ---------------------------------------------------------------- observability
    def vtoken_pool_report(self) -> PoolReport:
        """The pool in a few numbers (messages.PoolReport), for replicas' frequent reports."""
        live = retained = naive = 0
        for rid, table in self.vt_tables.items():
            live += table.num_live
            retained += len(self.vt_manager.req_to_blocks.get(rid, [])) + len(self.vt_ballast.get(rid, []))
            naive += naive_retained_blocks(table.live_mask(), self.vt_bs)
        t = self.vt_totals
        return PoolReport(
            free_blocks=self.vt_pool.get_num_free_blocks(),
            total_blocks=self.vt_pool.num_gpu_blocks - 1,
            kv_cache_usage=self.vt_pool.get_usage(),
            running=len(self.running),
            waiting=len(self.waiting),
            live_tokens=live,
            retained_blocks=retained,
            naive_retained_blocks=naive,
            blocks_reclaimed=max(naive - retained, 0),
            admitted=tuple(sorted(r.request_id for r in self.vt_records.values())),
            blocks_freed_total=t.blocks_freed,
            tokens_evicted_total=t.tokens_evicted,
            tokens_moved_total=t.tokens_moved,
            compaction_seconds_total=t.compaction_seconds,
            preemptions_total=t.preemptions,
            block_size=self.vt_bs,
        )

    def vtoken_stats(self, reset: bool = False) -> dict[str, Any]:
        """Per-request and per-engine figures (see vtoken/vllm_adapter/stats.py for the definitions).
        ``reset``: afterwards start peak_running and the finished-request list afresh (benchmarks)."""
        reqs = {}
        for rid, table in self.vt_tables.items():
            n_blocks = len(self.vt_manager.req_to_blocks.get(rid, []))
            reqs[rid] = self.vt_records[rid].snapshot(table, n_blocks, len(self.vt_ballast.get(rid, [])))
        out = {
            "mode": self.vt.mode,
            "policy": self.vt.policy,
            "block_size": self.vt_bs,
            "free_blocks": self.vt_pool.get_num_free_blocks(),
            "total_blocks": self.vt_pool.num_gpu_blocks - 1,
            "kv_cache_usage": self.vt_pool.get_usage(),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "requests": reqs,
            **self.vt_totals.summary(reqs, self.vt_bs),
        }
        if reset:
            self.vt_totals.peak_running = len(self.running)
            self.vt_totals.finished.clear()
        return out


def external_id(rid: str) -> str:
    """The caller's request id: vllm/v1/engine/input_processor.py InputProcessor.assign_request_id appends
    "-" and 8 random characters. Randomised policies seed from the caller's id, so that reruns, naive and
    vtoken, and every TP rank reach the same decisions."""
    head, _, tail = rid.rpartition("-")
    return head if head and len(tail) == 8 else rid


UTILITIES = ("vtoken_stats", "vtoken_pool_report")


def install_engine_core_utilities() -> None:
    """Make the scheduler's ``vtoken_stats`` and ``vtoken_pool_report`` callable through vLLM's utility RPC
    (vllm/v1/engine/core.py EngineCore._handle_client_request looks a utility up with getattr on the
    EngineCore). Called when a VTokenScheduler is built, in the EngineCore's own process, never on import."""
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
