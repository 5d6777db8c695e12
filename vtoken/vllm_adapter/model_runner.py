"""Worker side of vToken: a mixin over vLLM's V1 GPUModelRunner (and its CPUModelRunner subclass).

Per step, before vLLM's own code runs: apply the scheduler's moves (one gather-then-scatter over every
layer, plus the attention statistics; on CUDA issued on a side stream, each layer's attention waiting only
for its own layers' moves: move_waits.py), truncate the block lists of compacted requests, and record each
request's gap (logical - physical length). Then, in ``_prepare_inputs``, positions stay LOGICAL (RoPE),
while slot mapping and ``seq_lens`` become PHYSICAL (position - gap): attention reads exactly the packed
slots, in which no dead token remains. The same split serves prefill chunks and decode steps.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from vtoken.config import VTokenConfig
from vtoken.core.policies import ATTN_SUM
from vtoken.kv.kv_dtype import KvFormat
from vtoken.kv.mover import Mover
from vtoken.kv.mover_factory import make_mover
from vtoken.kv.query_window import QueryWindow
from vtoken.kv.tier import KVTier
from vtoken.kv.worker_step import apply_kv_step
from vtoken.vllm_adapter import move_waits
from vtoken.vllm_adapter import scores as scores_mod
from vtoken.vllm_adapter.cpu_layout import learn_cpu_layout
from vtoken.vllm_adapter.engine import tier_tokens
from vtoken.vllm_adapter.messages import VTokenStep, VTokenWorkerOutput
from vtoken.vllm_adapter.tp import TensorParallel


class VTokenRunnerMixin:
    """Overrides for vllm/v1/worker/gpu_model_runner.py GPUModelRunner (V1). Put it before the runner."""

    def _vt_setup(self) -> None:
        self.vt = VTokenConfig.from_vllm(self.vllm_config)
        self.vt_policy = self.vt.make_policy()
        self.vt_gaps: dict[str, int] = {}
        self.vt_observe: dict[str, int] = {}
        self.vt_export: dict[str, tuple[str, ...]] = {}
        self.vt_export_len: dict[str, int] = {}
        self.vt_mover: Mover | None = None
        self.vt_scorer: scores_mod.AttentionScorer | None = None
        self.vt_tier: KVTier | None = None  # parking's second tier (vtoken/kv/tier.py)
        self.vt_window: QueryWindow | None = None  # each decoding request's recent queries (vtoken/kv/query_window.py)
        self.vt_record: tuple[str, ...] = ()
        self.vt_window_ask: dict[str, tuple[str, ...]] = {}
        self.vt_window_len: dict[str, int] = {}
        self.vt_window_scored = 0  # windows scored since the engine started (tests count them)
        self.vt_window_parked: dict[str, np.ndarray] = {}
        self.vt_recall_bytes_sent = 0
        # VTOKEN_RECALL_AUDIT=1: each recall by summaries is checked against the exact path (vtoken_score_counts)
        audit = os.environ.get("VTOKEN_RECALL_AUDIT") == "1"
        self.vt_recall_audit = dict.fromkeys(("recalls", "top", "found", "parked", "candidates"), 0) if audit else None
        self.vt_decode_scored = 0  # decode queries the per-step scorer scored (0 for an on-demand policy)
        self.vt_joint: dict[str, np.ndarray] = {}
        self.vt_move_seconds = 0.0
        self.vt_bytes_moved = 0
        self.vt_tp = TensorParallel.current()  # a world of one without tensor parallelism

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        """Mirror of GPUModelRunner.initialize_kv_cache: then build the mover and the scorer."""
        out = super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        bs = spec.block_size
        forward_context = self.compilation_config.static_forward_context
        # An fp8 cache (kv_cache_dtype fp8*): uint8 storage that moves as bytes and is read through each layer's
        # scales (vtoken/kv/kv_dtype.py); otherwise the model's dtype, read as it is.
        fmt = KvFormat.of(self.cache_config.cache_dtype, self.kv_caches, list(forward_context.values()))
        self.vt_kv_format = fmt
        if self.device.type == "cpu":  # the kernel vLLM picked here decides the layout (AMX packs bf16)
            layout = learn_cpu_layout(forward_context, self.kv_caches[0].dtype, bs, spec.head_size, fmt,
                                      self.model_config.dtype)  # fmt: skip
        else:
            layout = "flash"
        self.vt_mover = make_mover(self.device, bs, layout)
        if self.vt_policy.needs or self.vt.collect_scores:
            num_slots = int(self.kv_caches[0].shape[0]) * bs
            self.vt_scorer = scores_mod.AttentionScorer(num_slots, bs, layout, self.device, self.vt_tp, fmt)
            park = tier_tokens(self.vt, self.vllm_config, kv_cache_config, self.device.type)  # = the scheduler's
            if park:
                self.vt_tier = KVTier(park, self.kv_caches, layout, bs, spec.head_size, self.vt_scorer.extra_tensors,
                                      self.vt_tp, fmt)  # fmt: skip
            if self.vt_policy.window_scores or self.vt.collect_scores:  # snapkv, of the engine or of one request
                heads = self.model_config.get_num_attention_heads(self.parallel_config)
                self.vt_window = QueryWindow(self.max_num_reqs, self.kv_caches, layout, bs, heads, spec.head_size,
                                             self.vt.decode_window, self.model_config.dtype if fmt.quantised else None,
                                             tp=self.vt_tp, fmt=fmt)  # fmt: skip
            scores_mod.install(forward_context, scores_mod.Observers(self.vt_scorer, self.vt_tier, self.vt_window))
        # CUDA: bind the fused mover to the caches once (fixed addresses) and make each layer wait for its moves
        extra = self.vt_scorer.extra_tensors if self.vt_scorer else []
        move_waits.install(forward_context, self.vt_mover, self.kv_caches, extra)
        return out

    # ---------------------------------------------------------------- before vLLM's step
    def execute_model(self, scheduler_output, *args, **kwargs):
        """Mirror of GPUModelRunner.execute_model: apply the step's vToken data first."""
        step: VTokenStep | None = getattr(scheduler_output, "vtoken", None)
        if step is not None:
            with self.vt_tp.applying(step):  # TP: every rank applied the plan, or every rank raises
                self._vt_apply(step, scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _vt_apply(self, step: VTokenStep, so) -> None:
        extra = self.vt_scorer.extra_tensors if self.vt_scorer else []
        if self.vt_tier is not None:
            self.vt_tier.free(step.tier_freed)  # before this step's parks may take them again
        cost = apply_kv_step(self._vt_step_mover(), self.vt_tier, self.kv_caches, extra, step.moves, step.park,
                             step.restore)  # fmt: skip
        self.vt_move_seconds += cost.move_seconds
        self.vt_bytes_moved += cost.bytes_moved
        if len(step.moves):
            self._vt_order_moves(so)
        self.vt_joint = step.joint
        for rid, keep in step.keep_blocks.items():
            self._vt_set_blocks(rid, lambda ids, keep=keep: ids[:keep])
        for rid, blocks in step.set_blocks.items():  # re-inflation: parked tokens back into blocks added for them
            self._vt_set_blocks(rid, lambda ids, blocks=blocks: list(blocks))
        self.vt_gaps.update(step.gaps)
        for rid in so.finished_req_ids:
            self.vt_gaps.pop(rid, None)
        for rid in so.scheduled_cached_reqs.resumed_req_ids:
            self.vt_gaps.pop(rid, None)  # resumed after preemption: recomputed from scratch, no gap
        for new in so.scheduled_new_reqs:
            self.vt_gaps.pop(new.req_id, None)  # (re)admitted as new: no gap yet, whatever it had before
        if self.vt_window is not None:  # a request that ends or starts over gives its window back
            for rid in (*so.finished_req_ids, *so.scheduled_cached_reqs.resumed_req_ids,
                        *(n.req_id for n in so.scheduled_new_reqs)):  # fmt: skip
                self.vt_window.release(rid)
            for rid in step.keep_blocks:  # its tokens moved (a decision, a shed): earlier queries' positions are off
                row = self.vt_window.owner.get(rid)
                if row is not None:
                    self.vt_window.clear(row)
        self.vt_observe, self.vt_export = step.observe, step.export
        self.vt_record, self.vt_window_ask = step.record, step.window
        self.vt_window_parked = step.window_parked

    def _vt_step_mover(self) -> Mover:
        """The mover of this step's moves (the testing runner's negative control swaps in one that skips them)."""
        return self.vt_mover

    def _vt_order_moves(self, so) -> None:
        """CUDA: what the forward's stream waits for before the forward (the moves run on a side stream). vLLM
        zeroes and copies blocks before the forward (GPUModelRunner._update_states: new_block_ids_to_zero,
        kv_cache_block_copies), maybe a block a move reads: then every move; else only what no attention hook
        waits for (move_waits.py): the per-slot statistics, which _prepare_inputs resets. On CPU both are no-ops."""
        if getattr(so, "new_block_ids_to_zero", None) or getattr(so, "kv_cache_block_copies", None):
            self.vt_mover.wait()
        else:
            self.vt_mover.wait_unhooked()

    def _vt_set_blocks(self, rid: str, new) -> None:
        """Rewrite a request's block list in CachedRequestState and in the persistent batch together: a
        request re-added to the batch is rebuilt from the former (GPUModelRunner._update_states)."""
        state = self.requests.get(rid)
        if state is None:
            return
        ids = state.block_ids[0]  # vToken runs one full-attention KV group (checked by the scheduler)
        ids[:] = new(ids)
        row = self.input_batch.req_id_to_index.get(rid)
        if row is not None:
            self.input_batch.block_table.add_row(state.block_ids, row)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        """Mirror of GPUModelRunner._prepare_inputs, then split positions (logical, for RoPE) from slots
        and seq_lens (physical)."""
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        total = scheduler_output.total_num_scheduled_tokens
        req_ids = self.input_batch.req_ids[:num_reqs]
        if self.vt_gaps:
            gaps = np.array([self.vt_gaps.get(r, 0) for r in req_ids], np.int64)
            if gaps.any():
                g = torch.from_numpy(gaps)
                req_idx = torch.from_numpy(self.req_indices.np[:total].astype(np.int64))
                physical = self.positions[:total] - g[req_idx].to(self.positions.device)
                self.seq_lens[:num_reqs] -= g.to(self.seq_lens.device, self.seq_lens.dtype)
                self.optimistic_seq_lens_cpu[:num_reqs] -= g.to(self.optimistic_seq_lens_cpu.dtype)
                self.input_batch.block_table.compute_slot_mapping(
                    num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical
                )
                self._vt_physical_positions(total, physical)
        if self.vt_scorer is not None:
            self.vt_scorer.reset_slots(self.input_batch.block_table[0].slot_mapping.gpu[:total].long())
            observe, rows = self.vt_observe, self.input_batch.req_id_to_index
            picked = [(rows[r], n) for r, n in observe.items() if r in rows]
            prompt_lens, done = self.input_batch.num_prompt_tokens, self.input_batch.num_computed_tokens_cpu
            self.vt_decode_scored += sum(1 for i, _ in picked if done[i] >= prompt_lens[i])
            self.vt_scorer.begin_step(
                np.array([p[0] for p in picked], np.int64), np.array([p[1] for p in picked], np.int64)
            )
            if self.vt_tier is not None:
                self.vt_tier.begin([(rows[r], observe[r], t) for r, t in self.vt_joint.items() if r in rows])
            # Physical length of each exported request once this forward has written its tokens.
            computed = self.input_batch.num_computed_tokens_cpu
            after = {r: int(computed[rows[r]] + num_scheduled_tokens[rows[r]]) - self.vt_gaps.get(r, 0)
                     for r in (*self.vt_export, *self.vt_window_ask) if r in rows}  # fmt: skip
            self.vt_export_len = {r: after[r] for r in self.vt_export if r in after}
            self.vt_window_len = {r: after[r] for r in self.vt_window_ask if r in after}
            if self.vt_window is not None:  # each recorded decode query: its token in the forward, its position
                starts, entries = self.query_start_loc.np, []
                for r in self.vt_record:
                    slot = self.vt_window.row_of(r) if r in rows else None
                    if slot is not None:
                        i = rows[r]
                        entries.append((slot, int(starts[i]), int(computed[i]) - self.vt_gaps.get(r, 0)))
                self.vt_window.begin(entries)
        return result

    def _vt_physical_positions(self, total: int, physical: torch.Tensor) -> None:
        """Hook for negative controls (vtoken/vllm_adapter/testing.py): RoPE keeps the logical positions."""

    # ---------------------------------------------------------------- after the forward
    def sample_tokens(self, *args, **kwargs):
        """Mirror of GPUModelRunner.sample_tokens: attach the statistics the scheduler asked for."""
        self.vt_rewind = self._vt_cpu_generators_to_rewind()
        out = super().sample_tokens(*args, **kwargs)
        vt = VTokenWorkerOutput(move_seconds=self.vt_move_seconds, bytes_moved=self.vt_bytes_moved)
        self.vt_move_seconds, self.vt_bytes_moved = 0.0, 0
        scorer = self.vt_scorer
        t0 = time.perf_counter()
        if scorer is not None:
            scorer.end_step()
            if self.vt_tier is not None:
                self.vt_tier.end(scorer)  # the last chunks' joint windows replace their live slots' statistics
            for rid, length in self.vt_export_len.items():
                state = self.requests.get(rid)
                if state is not None:
                    vt.stats[rid] = scorer.export(state.block_ids[0], length, self.vt_export[rid])
                    if rid in self.vt_joint:
                        vt.stats[rid].update(self.vt_tier.export(self.vt_joint[rid], self.vt_export[rid]))
            window = self.vt_window
            for rid, length in self.vt_window_len.items():  # on demand: the window, scored once before a decision
                state, row = self.requests.get(rid), window.owner.get(rid) if window is not None else None
                if state is None or row is None:
                    continue
                parked = self.vt_window_parked.get(rid)
                if parked is not None and self.vt_tier is not None:  # recall: live and parked keys, one softmax
                    wanted = None if self.vt.recall_exact else recall_candidates(length, self.vt_tier.PAGE)
                    t_recall = time.perf_counter()
                    live, held = window.score_with_parked(row, state.block_ids[0], length, self.kv_caches,
                                                          self.vt_tier, parked, wanted)  # fmt: skip
                    vt.recall_seconds += time.perf_counter() - t_recall
                    if self.vt_recall_audit is not None and wanted is not None:
                        self._vt_audit_recall(row, state.block_ids[0], length, parked, held)
                    vt.stats[rid] = {ATTN_SUM: live, f"parked:{ATTN_SUM}": held, "parked:slots": parked}
                else:
                    vt.stats[rid] = {ATTN_SUM: window.score(row, state.block_ids[0], length, self.kv_caches)}
                window.clear(row)
                self.vt_window_scored += 1
        vt.score_seconds = time.perf_counter() - t0
        if self.vt_tier is not None:
            vt.recall_bytes = self.vt_tier.bytes_recalled - self.vt_recall_bytes_sent
            self.vt_recall_bytes_sent = self.vt_tier.bytes_recalled
        target = getattr(out, "model_runner_output", out)  # async outputs wrap the real one
        if target is not None:
            target.vtoken = vt
        return out

    def _vt_audit_recall(self, row: int, block_ids, length: int, parked: np.ndarray, held: np.ndarray) -> None:
        """VTOKEN_RECALL_AUDIT=1 (benchmarks): score the same window over every parked token exactly too, and count
        how many of the exact path's top 32 parked tokens the summary's candidates held (its recall)."""
        _, exact = self.vt_window.score_with_parked(row, block_ids, length, self.kv_caches, self.vt_tier, parked)
        top = np.argsort(-exact, kind="stable")[: min(32, parked.size)]
        a = self.vt_recall_audit
        a["recalls"] += 1
        a["top"] += int(top.size)
        a["found"] += int((held[top] > 0).sum())  # a candidate scores > 0; the others score 0
        a["parked"] += int(parked.size)
        a["candidates"] += int((held > 0).sum())

    # ---------------------------------------------------------------- seeded requests on CPU
    def _vt_cpu_generators_to_rewind(self) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
        """The CPU generators of this step's discarded samples (a partial prefill, such as the forward that stops
        one token short of the prompt's end for parking), with their state before sampling. vLLM rewinds such a
        generator by its Philox offset (vllm/v1/worker/gpu_model_runner.py GPUModelRunner._bookkeeping_sync:
        ``gen.set_offset(gen.get_offset() - 4)``), which a CPU generator does not have: it raised "CPU Generator
        does not use offset" and stopped the engine for every request whenever a seeded request's prompt was read
        in more than one forward. On CPU the state taken here is put back instead (``_bookkeeping_sync``)."""
        n = self.input_batch.num_reqs
        out = {}
        for i in np.nonzero(self.discard_request_mask.np[:n])[0].tolist():
            gen = self.input_batch.generators.get(i)
            if gen is not None and gen.device.type == "cpu":
                out[i] = (gen, gen.get_state())
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        """Mirror of GPUModelRunner._bookkeeping_sync, whose rewind of a discarded sample's generator works on
        CUDA only: on CPU the generators saved in ``sample_tokens`` are hidden from it and their states restored,
        which undoes the discarded sample's draws exactly as the offset does on CUDA."""
        rewind, self.vt_rewind = getattr(self, "vt_rewind", {}), {}
        generators = self.input_batch.generators
        for i in rewind:
            generators.pop(i, None)
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            for i, (gen, state) in rewind.items():
                gen.set_state(state)
                generators[i] = gen


RECALL_PAGES = 16  # at most this many pages of parked tokens are scored exactly per recall (the summary path)


def recall_candidates(live: int, page: int) -> int:
    """Parked tokens a recall scores exactly after its page boxes: half the request's live tokens, at least two
    pages and at most RECALL_PAGES (on a GPU, what crosses from host memory per recall: 512 tokens' keys, 33.5 MB
    for Llama-3.1-8B in bf16, whatever its context)."""
    return min(RECALL_PAGES * page, max(2 * page, live // 2))


def runner_cls(base: type, *mixins: type) -> type:
    """vToken's runner over one of vLLM's V1 runners (CPUModelRunner or GPUModelRunner); ``mixins`` go first
    (the testing runner's negative controls)."""

    class VTokenModelRunner(*mixins, VTokenRunnerMixin, base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._vt_setup()

    VTokenModelRunner.__name__ = VTokenModelRunner.__qualname__ = f"VToken{base.__name__}"
    return VTokenModelRunner
