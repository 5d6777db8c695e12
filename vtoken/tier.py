"""KVTier: the worker's half of parking (vtoken/park.py): the parked tokens' K and V outside vLLM's pool, their
per-slot statistics, and the joint scoring of a last chunk's window over live and parked keys. No vLLM.

Storage is token-major whatever the pool's layout: per layer ``[capacity, kv_heads, 2 * head_size]`` (K then V),
plus one ``[capacity]`` tensor per statistic that travels with tokens (``AttentionScorer.extra_tensors``). A
token is copied between the pool and the tier through the pool layout's element positions
(``TableLayout.positions``; a view layout is turned into its table), so every layout vToken moves, it parks.

Order within a step: ``fetch`` the restored tokens out of the tier, ``park`` (pool -> tier), the step's compaction
moves, then ``restore`` (the fetched tokens -> pool). Parked tokens leave slots the packing then fills, restored
tokens land in slots the packing emptied, and a tier slot one request leaves may be taken by another's parking in
the same step: reading every source first and writing every destination after keeps each byte right.

Joint window (``begin``/``observe``/``end``): for a request whose last prefill chunk runs with parked tokens, the
chunk's last ``n_q`` queries are scored over its live keys (causal) and all its parked keys (all earlier) in ONE
softmax per layer, head and query; the same two statistics as vtoken/scores.py (``attn_sum``: the weights
summed over layers, heads and queries; ``attn_hist``: one bit per query, share above uniform), but from this
window alone. They replace the live slots' statistics and fill the parked ones, so the choice among live and
parked tokens, and decoding after it, start from the question's attention (as decode-only eviction's do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vtoken.kv_layout import LAYOUTS, Layout, TableLayout, table_of
from vtoken.move_batch import MoveBatch
from vtoken.planner import to_global_slots
from vtoken.policies import ATTN_HIST, ATTN_SUM
from vtoken.scores import uniform_share


class KVTier:
    def __init__(
        self,
        capacity: int,
        kv_caches: Sequence[torch.Tensor],
        layout: Layout,
        block_size: int,
        head_size: int,
        extra: Sequence[torch.Tensor] = (),
        tp=None,
    ) -> None:
        self.capacity, self.bs, self.head_size, self.tp = int(capacity), block_size, head_size, tp
        table = layout if isinstance(layout, TableLayout) else TableLayout(table_of(LAYOUTS[layout], block_size,
                                                                                    head_size))  # fmt: skip
        self.table = table
        heads = kv_caches[0].shape[1]
        # Uninitialised: a slot is read only after a token was parked into it, and untouched host pages of a tier
        # that is rarely full cost no memory.
        self.kv = [torch.empty(capacity, heads, 2 * head_size, dtype=kv.dtype, device=kv.device) for kv in kv_caches]
        self.extra = [torch.empty(capacity, dtype=t.dtype, device=t.device) for t in extra]
        self._layer = {kv.data_ptr(): i for i, kv in enumerate(kv_caches)}
        self.bytes_moved = 0
        self._rows: list[tuple[int, int, np.ndarray]] = []

    def _positions(self, kv: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        s = torch.as_tensor(slots, dtype=torch.long, device=kv.device)
        return self.table.positions(kv, s // self.bs, s % self.bs)  # [n, kv_heads, 2 * head_size]

    # ------------------------------------------------------------------ moves
    def park(self, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor], batch: MoveBatch) -> None:
        """Copy pool slots ``batch.src`` (global) into tier slots ``batch.dst``: before the step's moves."""
        if not len(batch):
            return
        dst = torch.as_tensor(batch.dst, dtype=torch.long)
        for kv, t in zip(kv_caches, self.kv):
            t[dst.to(t.device)] = kv.view(-1)[self._positions(kv, batch.src)]
        src = torch.as_tensor(batch.src, dtype=torch.long)
        for pool_t, t in zip(extra, self.extra):
            t[dst.to(t.device)] = pool_t[src.to(pool_t.device)]
        self.bytes_moved += sum(t[:1].numel() * t.element_size() for t in self.kv) * len(batch)

    def fetch(self, batch: MoveBatch) -> list[torch.Tensor]:
        """Tier slots ``batch.src``, copied out (before this step's parking may reuse them)."""
        src = torch.as_tensor(batch.src, dtype=torch.long)
        return [t[src.to(t.device)] for t in [*self.kv, *self.extra]]

    def restore(
        self, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor], batch: MoveBatch, fetched
    ) -> None:
        """Write ``fetched`` (``fetch(batch)``) into pool slots ``batch.dst`` (global): after the step's moves."""
        if not len(batch):
            return
        for kv, got in zip(kv_caches, fetched):
            kv.view(-1)[self._positions(kv, batch.dst)] = got
        dst = torch.as_tensor(batch.dst, dtype=torch.long)
        for pool_t, got in zip(extra, fetched[len(self.kv) :]):
            pool_t[dst.to(pool_t.device)] = got
        self.bytes_moved += sum(t[:1].numel() * t.element_size() for t in self.kv) * len(batch)

    # ------------------------------------------------------------------ the joint window
    def begin(self, rows: list[tuple[int, int, np.ndarray]]) -> None:
        """This step's last chunks with parked tokens: (batch row, its window's queries, its tier slots)."""
        self._rows = rows
        self._w: dict[int, torch.Tensor] = {}
        self._where: dict[int, tuple[np.ndarray, int]] = {}
        self._heads = self._layers = 0

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float) -> None:
        """One attention layer (after it wrote its KV): the windows' weights over live + parked keys."""
        if not self._rows:
            return
        layer = self._layer.get(kv_cache.data_ptr())
        if layer is None:
            return
        d = self.head_size
        for row, n_q, tier_slots in self._rows:
            seq, end = int(md.seq_lens[row]), int(md.query_start_loc[row + 1])
            table = md.block_table[row].cpu().numpy()
            live = to_global_slots(np.arange(seq), table, self.bs)
            k_live = kv_cache.view(-1)[self._positions(kv_cache, live)][..., :d]  # [seq, kvh, D]
            k_parked = self.kv[layer][torch.as_tensor(tier_slots, device=kv_cache.device)][..., :d]
            k = torch.cat([k_live, k_parked]).float()  # [S, kvh, D]
            q = query[end - n_q : end].float()  # [n_q, H, D]
            group = q.shape[1] // k.shape[1]
            logits = torch.einsum("qkgd,skd->qkgs", q.view(n_q, k.shape[1], group, d), k) * scale
            pos = torch.arange(seq - n_q, seq, device=k.device)  # each query's physical position
            future = torch.arange(seq, device=k.device)[None, :] > pos[:, None]  # live keys after the query
            mask = torch.cat([future, torch.zeros(n_q, k.shape[0] - seq, dtype=torch.bool, device=k.device)], 1)
            logits = logits.masked_fill(mask[:, None, None, :], float("-inf"))
            w = torch.softmax(logits, dim=-1).sum(dim=(1, 2))  # [n_q, S]: summed over this layer's heads
            self._w[row] = self._w.get(row, 0) + w
            self._where[row] = (pos.cpu().numpy(), live)
        self._heads = query.shape[1]
        self._layers += 1

    def end(self, scorer) -> None:
        """The windows' statistics replace the live slots' (in ``scorer``'s per-slot tensors) and fill the
        parked slots' (the tier's)."""
        world = self.tp.world if self.tp is not None else 1
        for row, n_q, tier_slots in self._rows:
            w = self._w.get(row)
            if w is None:
                continue
            if self.tp is not None:
                w = self.tp.sum_scores(w)
            pos, live = self._where[row]
            seq = live.size
            total = self._layers * self._heads * world
            acc = w.sum(0)
            hist = torch.zeros(w.shape[1], dtype=torch.int64, device=w.device)
            keys = torch.arange(w.shape[1], device=w.device)
            for j in range(n_q):  # as the scorer folds: query by query, into the keys the query attends
                attends = (keys <= int(pos[j])) | (keys >= seq)
                hot = (w[j] / total > uniform_share(int(pos[j]) + 1 + len(tier_slots))).long()
                hist = torch.where(attends, (hist << 1) | hot, hist)
            live = torch.as_tensor(live, dtype=torch.long)
            tier = torch.as_tensor(tier_slots, dtype=torch.long)
            for name, pool_t, tier_t in zip((ATTN_SUM, ATTN_HIST), scorer.extra_tensors, self.extra):
                value = acc if name == ATTN_SUM else hist
                pool_t[live.to(pool_t.device)] = value[:seq].to(pool_t.dtype).to(pool_t.device)
                tier_t[tier.to(tier_t.device)] = value[seq:].to(tier_t.dtype).to(tier_t.device)
        self._rows = []

    def export(self, tier_slots: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The parked slots' statistics, as ``parked:<name>`` (aligned with ``tier_slots``)."""
        idx = torch.as_tensor(tier_slots, dtype=torch.long)
        src = dict(zip((ATTN_SUM, ATTN_HIST), self.extra))
        return {f"parked:{n}": src[n][idx.to(src[n].device)].cpu().numpy() for n in names}
