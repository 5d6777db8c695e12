"""The attention statistics of ``vtoken/kv/scores.py``, computed the plain way (STYLE principle 7).

Written to be obviously right, not fast: float64, one request, one query and one head at a time, K read
slot by slot through the block table. Three pieces, each usable alone:

  window_probs(q, k, scale)  full softmax attention probabilities of a sequence's last n_q queries
  fold(...)                  the statistics' update rule, applied query by query in order
  ReferenceScorer            AttentionScorer's interface on top of the two, over a paged KV cache

It lives in the package, beside the fast path (like ``ReferenceMover`` and ``plan_compaction_reference``),
so that tests, benchmarks and the GPU check can all import it without vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken.core.planner import to_global_slots
from vtoken.kv.kv_layout import LAYOUTS, TableLayout
from vtoken.kv.scores import ATTN_HIST, ATTN_SUM, uniform_share

NEAR_TIE = "near_tie"  # bool per slot: a hist bit of this slot was decided within TIE_RTOL of the threshold
TIE_RTOL = 1e-5  # ~100x the fp32 rounding of the fast path's shares, far below any real margin


def window_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities of the last n_q queries of a sequence.

    ``q`` [n_q, heads, D]; ``k`` [S, kv_heads, D], the sequence's keys in physical order. Query j sits at
    position p = S - n_q + j and attends to keys 0..p. Query head h reads kv head h // (heads // kv_heads),
    as vLLM groups them. Returns float64 [n_q, heads, S], zero after each query's position.
    """
    n_q, heads, _ = q.shape
    s, kv_heads = k.shape[:2]
    group = heads // kv_heads
    out = torch.zeros(n_q, heads, s, dtype=torch.float64)
    for j in range(n_q):
        p = s - n_q + j
        for h in range(heads):
            logits = (k[: p + 1, h // group].double() @ q[j, h].double()) * scale
            out[j, h, : p + 1] = torch.softmax(logits, dim=0)
    return out


def fold(
    acc: torch.Tensor,
    hist: torch.Tensor,
    near: torch.Tensor,
    weights: torch.Tensor,
    positions: list[int],
    slots: torch.Tensor,
    total_heads: int,
) -> None:
    """One step of one request, query by query in order.

    ``weights`` [n_q, S]: each observed query's attention over the request's keys, summed over layers and
    ALL heads; ``positions[j]`` the physical position of query j; ``slots`` [S] the global slot of key k;
    ``total_heads`` = layers x heads (all TP ranks). Every key k <= p_j gets ``acc += weight``, and a bit
    shifted into ``hist``: is its share (weight / total_heads) above the uniform share 1 / (p_j + 1)?
    """
    for j, p in enumerate(positions):
        idx = slots[: p + 1]
        w = weights[j, : p + 1].to(acc.dtype)
        acc[idx] += w
        share, uniform = w / total_heads, uniform_share(p + 1)
        hist[idx] = (hist[idx] << 1) | (share > uniform).long()
        near[idx] |= (share - uniform).abs() <= TIE_RTOL * uniform


class ReferenceScorer:
    """``vtoken.kv.scores.AttentionScorer``'s interface, computed with ``window_probs`` and ``fold``.

    Extra state: ``near_tie`` (exported under ``NEAR_TIE``), so that tests can tell a rounding-level tie
    at the hist threshold from a real difference. Statistics are float64.
    """

    def __init__(self, num_slots: int, block_size: int, layout, device=None, tp=None) -> None:
        self.block_size, self.layout, self.tp = block_size, layout, tp
        self.acc = torch.zeros(num_slots, dtype=torch.float64)
        self.hist = torch.zeros(num_slots, dtype=torch.int64)
        self.near = torch.zeros(num_slots, dtype=torch.bool)
        self.begin_step([], [])

    @property
    def extra_tensors(self) -> list[torch.Tensor]:
        return [self.acc, self.hist, self.near]

    def reset_slots(self, slots) -> None:
        for t in self.extra_tensors:
            t[torch.as_tensor(slots, dtype=torch.long).cpu()] = 0

    def begin_step(self, rows, n_queries) -> None:
        self._todo = [(int(r), int(n)) for r, n in zip(rows, n_queries)]
        self._weights: dict[int, torch.Tensor] = {}  # row -> [n_q, S], summed over layers and heads
        self._where: dict[int, tuple[list[int], torch.Tensor]] = {}  # row -> (query positions, key slots)
        self._layers = 0

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float, output=None) -> None:
        if not self._todo:
            return
        kv = kv_cache.cpu()
        if isinstance(self.layout, TableLayout):
            k_view = self.layout.tokens(kv)  # [blocks, bs, kv_heads, 2 * D], a copy
        else:
            k_view = LAYOUTS[self.layout](kv, self.block_size)[0]  # [blocks, bs, kv_heads, >= D]
        d = query.shape[-1]
        for r, n_q in self._todo:
            seq, end = int(md.seq_lens[r]), int(md.query_start_loc[r + 1])
            table = md.block_table[r].cpu().numpy()
            slots = torch.as_tensor(to_global_slots(np.arange(seq), table, self.block_size))
            k = torch.stack([k_view[int(s) // self.block_size, int(s) % self.block_size, :, :d] for s in slots])
            probs = window_probs(query[end - n_q : end].cpu(), k, scale)
            self._weights[r] = self._weights.get(r, 0) + probs.sum(1)
            self._where[r] = ([seq - n_q + j for j in range(n_q)], slots)
        self._layers += 1
        self._heads = query.shape[1]

    def end_step(self) -> None:
        world = self.tp.world if self.tp is not None else 1
        for r, w in self._weights.items():
            if self.tp is not None:
                w = self.tp.sum_scores(w)
            positions, slots = self._where[r]
            fold(self.acc, self.hist, self.near, w, positions, slots, self._layers * self._heads * world)
        self.begin_step([], [])

    def export(self, block_ids: list[int], physical_len: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        slots = torch.as_tensor(to_global_slots(np.arange(physical_len), block_ids, self.block_size))
        src = {ATTN_SUM: self.acc, ATTN_HIST: self.hist, NEAR_TIE: self.near}
        return {n: src[n][slots].numpy() for n in names}
