"""QueryWindow: each decoding request's last ``W`` queries, per layer, kept in one fixed buffer on the device, and
scored over the request's live keys once, just before a decision. Worker side, no vLLM.

SnapKV (Li et al., 2024) scores the prompt's tokens by the attention of an observation window of its last queries;
kvpress's DecodingPress does the same while decoding, from a buffer of recent hidden states it clears after each
compression. Here the buffer holds the queries themselves (after RoPE, as attention saw them), every query head
grouped by its KV head:

    q    [rows, layers, W, heads, head_size]   the model's dtype; a request owns one row while it decodes
    pos  [rows, W]                             each query's physical position when it was written

Per decode step each recorded request's query is written in place into its row's next ring slot (``begin`` sets the
step's rows and slots, ``record`` runs inside every attention layer's hook): an index_put into a buffer allocated
once, at a fixed address, so it runs under CUDA graphs like the movers' buffers and allocates nothing per step.
At a decision (``score``) the row's queries are scored over its live keys: softmax per query head over the keys at
or before the query's position, summed over the window, the heads and the layers: ``attn_sum`` as vtoken/kv/scores.py
defines it, from this window alone. The window then starts afresh (``clear``): the decision moves the request's
tokens, and the positions of queries written before it would no longer match their keys. Between two decisions the
request loses no token, so each query is scored over exactly the keys it attended when it ran. The runner also
clears a request's window whenever its tokens move (a shed in pressure mode may come without a scoring before it).

Pressure mode (``evict: "pressure"``): a request that keeps every token records its queries only while the pool
may run short within a window's steps, and its window is scored only when it may run short at the next step
(vtoken/core/compactor.py ``foresee``), so that the shed judges its tokens by recent queries; while memory is plentiful
the window costs nothing.

Cost. Memory: rows x layers x W x heads x head_size elements, rows = the engine's largest batch. Llama-3.1-8B (32
layers, 32 query heads of 128) in bf16 with W = 16: 4 MiB per request, 1 GiB at 256 running requests (0.7% of an
H200's memory; W = 8 halves it). SmolLM2-135M in fp32 on a CPU: 1.1 MiB per request, allocated but untouched until
written. Compute: one pass of W queries over the live keys per decision (a decision comes about once per KV block of
decoding), instead of one query over every live key at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vtoken.core.planner import to_global_slots
from vtoken.kv.kv_dtype import PLAIN, KvFormat
from vtoken.kv.kv_layout import LAYOUTS, Layout, TableLayout, table_of

DECODE_WINDOW = 16  # queries kept per request (VTokenConfig.decode_window)


class QueryWindow:
    def __init__(
        self,
        rows: int,
        kv_caches: Sequence[torch.Tensor],
        layout: Layout,
        block_size: int,
        heads: int,
        head_size: int,
        window: int = DECODE_WINDOW,
        dtype: torch.dtype | None = None,
        tp=None,
        fmt: KvFormat = PLAIN,
    ) -> None:
        if window < 1:
            raise ValueError(f"the decode window needs at least one query, got {window}")
        kv = kv_caches[0]
        self.rows, self.window, self.bs, self.heads, self.head_size, self.tp = (
            rows,
            window,
            block_size,
            heads,
            head_size,
            tp,
        )
        self.device = kv.device
        self.fmt = fmt  # keys are read through it (an fp8 cache: as fp8 times the layer's k_scale)
        if fmt.quantised and dtype is None:
            raise ValueError("a query window over an fp8 KV cache needs the queries' dtype (the model's)")
        dtype = dtype or kv.dtype
        # Uninitialised: a slot is read only once a query was written there (``count``).
        self.q = torch.empty(rows, len(kv_caches), window, heads, head_size, dtype=dtype, device=self.device)
        self._qtmp = torch.empty(rows, heads, head_size, dtype=dtype if fmt.quantised else kv.dtype, device=self.device)
        self.pos = torch.zeros(rows, window, dtype=torch.long, device=self.device)
        self.count = np.zeros(rows, np.int64)  # queries written since the row's last decision (host side)
        self._layer = {t.data_ptr(): i for i, t in enumerate(kv_caches)}
        self.table = layout if isinstance(layout, TableLayout) else TableLayout(table_of(LAYOUTS[layout], block_size,
                                                                                         head_size))  # fmt: skip
        # This step's recorded queries: (buffer row, ring slot, token index in the forward, physical position), in
        # index buffers of a fixed size; and each query's flat row of ``q`` seen as [rows * layers * W, H, D], for
        # every layer (an index_copy_ into a contiguous tensor: a strided index_put_ cost milliseconds a layer).
        self._idx = torch.zeros(4, rows, dtype=torch.long, device=self.device)
        self._host = torch.zeros(4, rows, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._flat = torch.zeros(len(kv_caches), rows, dtype=torch.long, device=self.device)
        self._layer_base = (torch.arange(len(kv_caches), device=self.device) * window)[:, None]
        self._q_rows = self.q.view(-1, heads, head_size)
        self._n = 0
        self.scale = 1.0
        self.owner: dict[str, int] = {}  # request -> its buffer row
        self._free = list(range(rows - 1, -1, -1))

    # ------------------------------------------------------------------ rows
    def row_of(self, request_id: str) -> int | None:
        """The request's buffer row, taken on its first recorded query (None: every row is taken)."""
        row = self.owner.get(request_id)
        if row is None and self._free:
            row = self.owner[request_id] = self._free.pop()
            self.count[row] = 0
        return row

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: its row is free again."""
        row = self.owner.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            self.count[row] = 0

    # ------------------------------------------------------------------ every decode step
    def begin(self, entries: list[tuple[int, int, int]]) -> None:
        """This step's recorded queries: (buffer row, token index in the forward, physical position)."""
        n = self._n = len(entries)
        if not n:
            return
        rows = np.array([e[0] for e in entries], np.int64)
        ring = self.count[rows] % self.window
        self.count[rows] += 1
        host = self._host.numpy()
        host[0, :n], host[1, :n] = rows, ring
        host[2, :n], host[3, :n] = [e[1] for e in entries], [e[2] for e in entries]
        self._idx[:, :n].copy_(self._host[:, :n], non_blocking=True)
        self.pos.index_put_((self._idx[0, :n], self._idx[1, :n]), self._idx[3, :n])
        layers = self._flat.shape[0]
        torch.add(self._layer_base, (self._idx[0, :n] * layers * self.window + self._idx[1, :n])[None, :],
                  out=self._flat[:, :n])  # fmt: skip

    def record(self, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float, output=None) -> None:
        """One attention layer's hook: this step's recorded queries into their rows' ring slots (in place)."""
        if not self._n:
            return
        layer = self._layer.get(kv_cache.data_ptr())
        if layer is None:
            return
        n = self._n
        tok = self._idx[2, :n]
        picked = torch.index_select(query, 0, tok, out=self._qtmp[:n]) if query.dtype == self._qtmp.dtype else (
            query.index_select(0, tok))  # fmt: skip
        self._q_rows.index_copy_(0, self._flat[layer, :n], picked.to(self.q.dtype))
        self.scale = scale

    observe = record  # an observer of every attention layer, beside the scorer and the tier

    # ------------------------------------------------------------------ at a decision
    GROUP_BYTES = 64 << 20  # the logits of one group of layers scored at once

    def score(self, row: int, block_ids: list[int], seq: int, kv_caches: Sequence[torch.Tensor]) -> np.ndarray:
        """``attn_sum`` of the request's ``seq`` physical slots from its window: float32 [seq], on the host. Layers
        are scored in groups (a few tensor ops a group, not a few a layer), each group's logits under
        ``GROUP_BYTES``."""
        n = int(min(self.count[row], self.window))
        if n == 0:
            return np.zeros(seq, np.float32)
        ring = torch.as_tensor(np.arange(self.count[row] - n, self.count[row]) % self.window, device=self.device)
        slots = torch.as_tensor(to_global_slots(np.arange(seq), block_ids, self.bs), device=self.device)
        positions = self.table.positions(kv_caches[0], slots // self.bs, slots % self.bs)[..., : self.head_size]
        pos = self.pos[row].index_select(0, ring)  # [n]
        future = torch.arange(seq, device=self.device)[None, :] > pos[:, None]  # [n, seq]: keys after each query
        kvh = kv_caches[0].shape[1]
        g = self.heads // kvh
        per_layer = n * self.heads * seq * 4
        step = max(1, min(len(kv_caches), self.GROUP_BYTES // max(per_layer, 1)))
        total = torch.zeros(seq, dtype=torch.float32, device=self.device)
        for first in range(0, len(kv_caches), step):
            layers = range(first, min(first + step, len(kv_caches)))
            k = torch.stack([self.fmt.keys(kv_caches[i].view(-1)[positions], i) for i in layers])  # [L, seq, kvh, D]
            q = self.q[row, first : first + len(layers)].index_select(1, ring).float()  # [L, n, H, D]
            logits = torch.einsum("lqkgd,lskd->lqkgs", q.view(len(layers), n, kvh, g, self.head_size), k)
            logits.mul_(self.scale).masked_fill_(future[None, :, None, None, :], float("-inf"))
            total += torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2, 3))
        if self.tp is not None:
            total = self.tp.sum_scores(total)
        return total.cpu().numpy()

    def score_with_parked(
        self,
        row: int,
        block_ids: list[int],
        seq: int,
        kv_caches: Sequence[torch.Tensor],
        tier,
        tier_slots: np.ndarray,
        candidates: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Recall: ``attn_sum`` of the request's ``seq`` live slots and of its parked tokens (``tier_slots`` in
        ``tier``, vtoken/kv/tier.py) from its window, each query's softmax taken over the live keys at or before it
        and every parked key (all older) together. Returns float32 [seq] and [len(tier_slots)], on the host.

        ``candidates`` (None: every parked token, the exact path): first the parked tokens' page boxes bound each
        query's logit (``sum_d max(q_d * lo_d, q_d * hi_d)``, Quest's bound; ArkVale's boxes); the pages with the
        highest bound, enough to hold ``candidates`` tokens, are scored exactly, and only their keys are read. The
        other parked tokens score 0 (they stay parked). The boxes live on the pool's device; on a GPU only the
        candidates' keys cross from host memory (``tier.bytes_recalled`` counts them, and a stale box's rebuild)."""
        n = int(min(self.count[row], self.window))
        parked = np.asarray(tier_slots, dtype=np.int64)
        if n == 0 or parked.size == 0:
            return np.zeros(seq, np.float32), np.zeros(parked.size, np.float32)
        ring = torch.as_tensor(np.arange(self.count[row] - n, self.count[row]) % self.window, device=self.device)
        q_all = self.q[row].index_select(1, ring).float()  # [L, n, H, D]
        chosen = np.arange(parked.size)
        if candidates is not None and candidates < parked.size:
            chosen = self._candidates(q_all, tier, parked, candidates)
        slots = torch.as_tensor(to_global_slots(np.arange(seq), block_ids, self.bs), device=self.device)
        positions = self.table.positions(kv_caches[0], slots // self.bs, slots % self.bs)[..., : self.head_size]
        pos = self.pos[row].index_select(0, ring)
        future = torch.arange(seq, device=self.device)[None, :] > pos[:, None]  # [n, seq]
        kvh = kv_caches[0].shape[1]
        g = self.heads // kvh
        live_total = torch.zeros(seq, dtype=torch.float32, device=self.device)
        parked_total = torch.zeros(chosen.size, dtype=torch.float32, device=self.device)
        for layer, kv in enumerate(kv_caches):
            k = self.fmt.keys(kv.view(-1)[positions], layer)  # [seq, kvh, D]
            kp = tier.keys(layer, parked[chosen]).to(self.device)  # [c, kvh, D]
            q = q_all[layer].view(n, kvh, g, self.head_size)
            live = torch.einsum("qkgd,skd->qkgs", q, k).mul_(self.scale)
            live.masked_fill_(future[:, None, None, :], float("-inf"))
            held = torch.einsum("qkgd,skd->qkgs", q, kp).mul_(self.scale)
            w = torch.softmax(torch.cat([live, held], dim=-1), dim=-1).sum(dim=(0, 1, 2))
            live_total += w[:seq]
            parked_total += w[seq:]
        tier.bytes_recalled += int(chosen.size) * len(kv_caches) * kvh * self.head_size * kv_caches[0].element_size()
        if self.tp is not None:
            both = self.tp.sum_scores(torch.cat([live_total, parked_total]))
            live_total, parked_total = both[:seq], both[seq:]
        out = np.zeros(parked.size, np.float32)
        out[chosen] = parked_total.cpu().numpy()
        return live_total.cpu().numpy(), out

    def _candidates(self, q_all: torch.Tensor, tier, parked: np.ndarray, want: int) -> np.ndarray:
        """Indices into ``parked`` of the tokens in the pages whose boxes bound the window's logits highest (over
        layers, queries and heads), page by page until ``want`` tokens are in."""
        page_of = parked // tier.PAGE
        pages = np.unique(page_of)
        lo, hi = tier.boxes(pages)
        layers, n = q_all.shape[0], q_all.shape[1]
        kvh = lo[0].shape[1]
        g = self.heads // kvh
        best = torch.full((pages.size,), float("-inf"), device=lo[0].device)
        for layer in range(layers):
            q = q_all[layer].view(n, kvh, g, self.head_size).to(lo[0].device)  # [n, kvh, g, D]
            # sum_d max(q_d * lo_d, q_d * hi_d) = q+ . hi + q- . lo, as two matrix products
            bound = torch.einsum("qkgd,pkd->qkgp", q.clamp(min=0), hi[layer]) + torch.einsum(
                "qkgd,pkd->qkgp", q.clamp(max=0), lo[layer]
            )
            best = torch.maximum(best, bound.amax(dim=(0, 1, 2)))
        order = pages[torch.argsort(best, descending=True, stable=True).cpu().numpy()]
        counts = np.bincount(np.searchsorted(pages, page_of), minlength=pages.size)
        per_page = dict(zip(pages.tolist(), counts.tolist()))
        take, got = [], 0
        for page in order.tolist():
            if got >= want:
                break
            take.append(page)
            got += per_page[page]
        return np.flatnonzero(np.isin(page_of, take))

    def clear(self, row: int) -> None:
        """Scored before a decision, or the request's tokens moved: the window starts afresh (module docstring)."""
        self.count[row] = 0
