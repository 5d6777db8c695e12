"""Attention statistics for H2O and Scissorhands, captured on the device per physical slot.

We wrap each attention layer's ``impl.forward`` (vllm/model_executor/layers/attention/attention.py calls
``layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, ...)`` after RoPE): for every
request decoding one token, its query's softmax attention over the request's physical slots is recomputed
from the KV cache and summed over heads into ``step_w``. At the end of the step that is folded into

  * ``attn_sum``  [num_slots] float32: attention received, summed over heads, layers and decode steps;
  * ``attn_hist`` [num_slots] int64: shift register, bit 0 = "above the uniform share 1/seq_len" this step.

Both live in global-slot tensors that the mover moves with their tokens, and are zeroed when a slot gets
a new token. Nothing leaves the device unless the scheduler asks for a request's statistics.

With tensor parallelism each rank sees only its own heads: before folding, the step's weights over the
decode slots are summed across the TP group (``tp.TensorParallel.sum_scores``), and the uniform share is
taken over the GLOBAL head count, so every rank folds the same numbers a single GPU would.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken.mover import LAYOUTS
from vtoken.planner import to_global_slots
from vtoken.policies import ATTN_HIST, ATTN_SUM
from vtoken.vllm_adapter.tp import TensorParallel


class AttentionScorer:
    def __init__(
        self, num_slots: int, block_size: int, layout: str, device: torch.device, tp: TensorParallel | None = None
    ) -> None:
        self.block_size, self.layout = block_size, layout
        self.tp = tp or TensorParallel()
        self.acc = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.hist = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.step_w = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self._step: tuple | None = None  # (rows, lens, slots, req_of) of this step's decode requests
        self._layers = 0
        self._heads = 1  # query heads on this rank
        self._want = torch.empty(0, dtype=torch.int64)
        self.rows: np.ndarray = np.empty(0, np.int64)
        self.lens: np.ndarray = np.empty(0, np.int64)

    @property
    def extra_tensors(self) -> list[torch.Tensor]:
        return [self.acc, self.hist]

    def begin_step(self, rows: np.ndarray, n_queries: np.ndarray) -> None:
        """Batch rows to observe this step (interim: decode rows only; prefill windows come with the fast scorer)."""
        self._want = torch.as_tensor(np.asarray(rows, np.int64))

    def reset_slots(self, slots: torch.Tensor) -> None:
        """New tokens start with no history."""
        self.acc[slots] = 0
        self.hist[slots] = 0

    def _decode_slots(self, md) -> tuple | None:
        qsl = md.query_start_loc
        qlens = qsl[1:] - qsl[:-1]
        rows = torch.nonzero(qlens == 1).flatten()
        rows = rows[torch.isin(rows, self._want.to(rows.device))]
        if rows.numel() == 0:
            return None
        lens = md.seq_lens[rows].long()
        req_of = torch.repeat_interleave(torch.arange(rows.numel(), device=lens.device), lens)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(int(lens.sum()), device=lens.device) - starts[req_of]
        bt = md.block_table[rows].long()
        slots = bt[req_of, pos // self.block_size] * self.block_size + pos % self.block_size
        return rows, lens, slots, req_of, qsl[rows].long()

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float) -> None:
        if self._step is None:
            self._step = self._decode_slots(md)
            if self._step is None:
                self._step = ()
        if not self._step:
            return
        rows, lens, slots, req_of, q_idx = self._step
        k_view = LAYOUTS[self.layout](kv_cache, self.block_size)[0]  # [nb, bs, kv_heads, head_size]
        k = k_view[slots // self.block_size, slots % self.block_size].float()
        q = query[q_idx].float()  # [R, heads, head_size]
        heads, kv_heads = q.shape[1], k.shape[1]
        q = q.view(q.shape[0], kv_heads, heads // kv_heads, -1)
        logits = torch.einsum("thd,thgd->thg", k, q[req_of]) * scale  # [total, kv_heads, group]
        idx = req_of.view(-1, 1, 1).expand_as(logits)
        m = torch.full((rows.numel(),) + logits.shape[1:], -torch.inf, device=logits.device)
        m = m.scatter_reduce(0, idx, logits, "amax")
        e = torch.exp(logits - m[req_of])
        z = torch.zeros_like(m).index_add_(0, req_of, e)
        self.step_w.index_add_(0, slots, (e / z[req_of]).sum((1, 2)))
        self._layers += 1
        self._heads = heads

    def end_step(self) -> None:
        """Fold this step's attention into the running statistics."""
        if self._step:
            rows, lens, slots, req_of, _ = self._step
            w = self.tp.sum_scores(self.step_w[slots])  # this rank's heads -> all heads
            self.acc[slots] += w
            share = w / max(self._layers * self._heads * self.tp.world, 1)
            hot = (share > 1.0 / lens[req_of].float()).long()
            self.hist[slots] = (self.hist[slots] << 1) | hot
            self.step_w[slots] = 0
            self.rows, self.lens = rows.cpu().numpy(), lens.cpu().numpy()
        else:
            self.rows, self.lens = np.empty(0, np.int64), np.empty(0, np.int64)
        self._step, self._layers = None, 0

    def export(self, block_ids: list[int], physical_len: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        slots = torch.as_tensor(
            to_global_slots(np.arange(physical_len), block_ids, self.block_size), device=self.acc.device
        )
        src = {ATTN_SUM: self.acc, ATTN_HIST: self.hist}
        return {n: src[n][slots].cpu().numpy() for n in names}


def install(attention_layers: dict, scorer: AttentionScorer) -> int:
    """Wrap every attention layer's impl.forward so the scorer sees its query and KV cache."""
    n = 0
    for layer in attention_layers.values():
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(impl, "_vtoken_wrapped", False) or not hasattr(impl, "forward"):
            continue
        orig = impl.forward

        def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, _orig=orig, _impl=impl, **kw):
            out = _orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kw)
            if attn_metadata is not None and kv_cache is not None and kv_cache.numel():
                scorer.observe(query, kv_cache, attn_metadata, _impl.scale)
            return out

        impl.forward = forward
        impl._vtoken_wrapped = True
        n += 1
    return n
