"""KVTier: the worker's half of parking (vtoken/core/park.py): the parked tokens' K and V outside vLLM's pool, in host
memory, their per-slot statistics, and the prompt's last chunk attending live and parked keys together. No vLLM.

Storage is token-major whatever the pool's layout: per layer ``[capacity, kv_heads, 2 * head_size]`` (K then V),
plus one ``[capacity]`` tensor per statistic that travels with tokens (``AttentionScorer.extra_tensors``), in host
memory (pinned when the pool is on a GPU). A token is copied between the pool and the tier through the pool
layout's element positions (``TableLayout.positions``; a view layout is turned into its table), so every layout
vToken moves, it parks.

Order within a step (vtoken/kv/worker_step.py): ``fetch`` the restored tokens out of the tier, ``park`` (pool -> tier),
the step's compaction moves, then ``restore`` (the fetched tokens -> pool). Parked tokens leave slots the packing
then fills, restored tokens land in slots the packing emptied, and a tier slot one request leaves may be taken by
another's parking in the same step: reading every source first and writing every destination after keeps each byte
right. On a GPU the pool is read on the compute stream (before the mover's stream may write it) and the copies
to and from host memory run on a side stream: a park lands in the tier before the tier is next read, a restore
waits for its fetch's copy.

The last chunk (``begin``/``observe``/``end``): for a request whose last prefill chunk runs with parked tokens, every
query of the chunk attends its live keys (causal) and all its parked keys (all earlier) in ONE softmax per layer
and head: the layer's output rows of that chunk are rewritten with it (``joint_attention``; the parked keys stream
in slices, from host memory on a GPU), so the next layer, the chunk's own K and V above the first layer, and the
first answer token see the whole prompt. Its last ``n_q`` queries (the window) give the same two statistics as
vtoken/kv/scores.py (``attn_sum``: the weights summed over layers, heads and queries; ``attn_hist``: one bit per
query, share above uniform), from this window alone. They replace the live slots' statistics and fill the parked
ones, so the choice among live and parked tokens, and decoding after it, start from the question's attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.core.planner import to_global_slots
from vtoken.core.policies import ATTN_HIST, ATTN_SUM
from vtoken.kv.kv_dtype import PLAIN, KvFormat
from vtoken.kv.kv_layout import LAYOUTS, Layout, TableLayout, table_of
from vtoken.kv.scores import uniform_share


class KVTier:
    SLICE_BYTES = 64 << 20  # the logits of one slice of parked keys: bounded however many tokens are parked
    MIN_SLICE = 256  # tokens
    PAGE = 32  # tier slots summarised by one box of keys (recall's first pass, ``boxes``)

    def __init__(
        self,
        capacity: int,
        kv_caches: Sequence[torch.Tensor],
        layout: Layout,
        block_size: int,
        head_size: int,
        extra: Sequence[torch.Tensor] = (),
        tp=None,
        fmt: KvFormat = PLAIN,
    ) -> None:
        self.capacity, self.bs, self.head_size, self.tp = int(capacity), block_size, head_size, tp
        table = layout if isinstance(layout, TableLayout) else TableLayout(table_of(LAYOUTS[layout], block_size,
                                                                                    head_size))  # fmt: skip
        self.table = table
        self.fmt = fmt  # the tier keeps the pool's bytes (an fp8 cache's uint8); keys and values are read through it
        heads = kv_caches[0].shape[1]
        self.device = kv_caches[0].device
        self.cuda = self.device.type == "cuda"
        # Host memory whatever the pool's device (pinned on CUDA, so copies to and from it are asynchronous DMA).
        # Uninitialised: a slot is read only after a token was parked into it, and untouched host pages of a CPU tier
        # that is rarely full cost no memory.
        host = {"device": "cpu", "pin_memory": self.cuda}
        self.kv = [torch.empty(capacity, heads, 2 * head_size, dtype=kv.dtype, **host) for kv in kv_caches]
        self.extra = [torch.empty(capacity, dtype=t.dtype, **host) for t in extra]
        self._layer = {kv.data_ptr(): i for i, kv in enumerate(kv_caches)}
        # Recall's summaries (Quest, ArkVale): per page of PAGE tier slots and per layer, the element-wise min and
        # max of the keys parked there, [pages, kv_heads, head_size] each, float32.
        # A park widens its page's box; a page whose slots were freed is rebuilt from the slots still held the next
        # time it is read, so a box always holds every key parked in its page and stays tight.
        pages = -(-capacity // self.PAGE)
        # On the pool's device (a GPU's memory: 2 / PAGE of the parked keys' bytes), so a recall bounds every parked
        # page there and only its candidates' keys cross from host memory.
        box = {"device": self.device, "dtype": torch.float32}
        self.box_lo = [torch.full((pages, heads, head_size), float("inf"), **box) for _ in kv_caches]
        self.box_hi = [torch.full((pages, heads, head_size), float("-inf"), **box) for _ in kv_caches]
        self.held = np.zeros(capacity, dtype=bool)  # tier slots holding a parked token (the scheduler frees them)
        self._stale = np.zeros(pages, dtype=bool)  # pages with a slot freed since their box was built
        self.bytes_moved = 0
        self.bytes_recalled = 0  # parked K read to score a recall (boxes and candidates)
        self.attend = True  # the last chunk attends the parked keys (False: only scores them; a negative control)
        self._rows: list[tuple[int, int, np.ndarray]] = []
        # CUDA: copies run on a side stream. A park lands in the tier once its copy is done (``_pending``, applied
        # before the tier is next read); a fetch's copy is waited for by the restore that writes it.
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self._fetched: torch.cuda.Event | None = None

    def _positions(self, kv: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        s = torch.as_tensor(slots, dtype=torch.long, device=kv.device)
        return self.table.positions(kv, s // self.bs, s % self.bs)  # [n, kv_heads, 2 * head_size]

    # ------------------------------------------------------------------ moves
    def park(self, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor], batch: MoveBatch) -> None:
        """Copy pool slots ``batch.src`` (global) into tier slots ``batch.dst``: before the step's moves (the pool
        is read here, on the current stream, before the mover's stream may write it)."""
        if not len(batch):
            return
        dst = torch.as_tensor(batch.dst, dtype=torch.long)
        src = torch.as_tensor(batch.src, dtype=torch.long, device=self.device)
        at = self._positions(kv_caches[0], batch.src)  # every layer's cache has the same shape and layout
        got = [kv.view(-1)[at] for kv in kv_caches] + [t[src] for t in extra]
        self._widen(batch.dst, got[: len(kv_caches)])  # on the pool's device, from the keys as they leave it
        self._store([*self.kv, *self.extra][: len(got)], dst, got)
        self.bytes_moved += sum(t[:1].numel() * t.element_size() for t in self.kv) * len(batch)

    def _store(self, tier: list[torch.Tensor], dst: torch.Tensor, got: list[torch.Tensor]) -> None:
        if not self.cuda:
            for t, g in zip(tier, got):
                t[dst] = g
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gathers above
        with torch.cuda.stream(self.stream):
            for t, g in zip(tier, got):
                staged = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                staged.copy_(g, non_blocking=True)
                g.record_stream(self.stream)
                done = torch.cuda.Event()
                done.record(self.stream)
                self._pending.append((t, dst, staged, done))

    def _land(self) -> None:
        """Parks whose copies have been issued land in the tier (CPU side): before anything reads it."""
        for t, dst, staged, done in self._pending:
            done.synchronize()  # long done: a park is read steps later, at the earliest the next step
            t[dst] = staged
        self._pending = []

    # ------------------------------------------------------------------ summaries for recall
    def free(self, slots: np.ndarray) -> None:
        """Tier slots the scheduler freed (restored, or their tokens freed for good): their pages' boxes are
        rebuilt before they are next read."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size:
            self.held[slots] = False
            self._stale[np.unique(slots // self.PAGE)] = True

    def _widen(self, dst: np.ndarray, layers: list[torch.Tensor]) -> None:
        """Keys parked into tier slots ``dst`` (``layers``: each layer's [n, kv_heads, 2 * head_size] K then V, on
        the pool's device): their pages' boxes grow to hold them."""
        slots = np.asarray(dst, dtype=np.int64)
        if not slots.size:
            return
        self.held[slots] = True
        page = torch.as_tensor(slots // self.PAGE, device=self.device)
        for layer, (got, lo, hi) in enumerate(zip(layers, self.box_lo, self.box_hi)):
            k = self.fmt.keys(got[..., : self.head_size], layer)  # [n, kvh, D] float32
            lo.index_reduce_(0, page, k, "amin")
            hi.index_reduce_(0, page, k, "amax")

    def boxes(self, pages: np.ndarray) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the boxes of ``pages``: [n, kv_heads, head_size] min and max keys (rebuilt first where a slot
        was freed: over the slots still held; an empty page's box is empty, +inf..-inf, and bounds nothing)."""
        self._land()
        stale = pages[self._stale[pages]]
        if stale.size:  # pages some of whose tokens left since they were last read: rebuilt from what is held
            slots = (stale[:, None] * self.PAGE + np.arange(self.PAGE)[None, :]).ravel()
            slots = slots[slots < self.capacity]
            slots = slots[self.held[slots]]
            rows = torch.as_tensor(stale, device=self.device)
            page = torch.as_tensor(slots // self.PAGE, device=self.device)
            host = torch.as_tensor(slots)
            for layer, (kv, lo, hi) in enumerate(zip(self.kv, self.box_lo, self.box_hi)):
                lo[rows], hi[rows] = float("inf"), float("-inf")
                if slots.size:
                    k = self.fmt.keys(kv[host][..., : self.head_size].to(self.device), layer)
                    lo.index_reduce_(0, page, k, "amin")
                    hi.index_reduce_(0, page, k, "amax")
            self.bytes_recalled += int(slots.size) * len(self.kv) * self.kv[0][0, :, : self.head_size].numel() * (
                self.kv[0].element_size())  # fmt: skip
            self._stale[stale] = False
        idx = torch.as_tensor(pages, device=self.device)
        return [lo[idx] for lo in self.box_lo], [hi[idx] for hi in self.box_hi]

    def keys(self, layer: int, slots: np.ndarray) -> torch.Tensor:
        """The parked keys of ``slots`` in ``layer``: float32 [n, kv_heads, head_size] (on the host)."""
        self._land()
        return self.fmt.keys(self.kv[layer][torch.as_tensor(slots, dtype=torch.long)][..., : self.head_size], layer)

    def fetch(self, batch: MoveBatch) -> list[torch.Tensor]:
        """Tier slots ``batch.src``, copied out (before this step's parking may reuse them); on CUDA onto the device,
        on the side stream (``restore`` waits for it)."""
        if not len(batch):
            return []  # most steps: nothing comes back
        self._land()
        src = torch.as_tensor(batch.src, dtype=torch.long)
        out = [t[src] for t in [*self.kv, *self.extra]]
        if not self.cuda:
            return out
        with torch.cuda.stream(self.stream):
            out = [o.pin_memory().to(self.device, non_blocking=True) for o in out]
            self._fetched = torch.cuda.Event()
            self._fetched.record(self.stream)
        return out

    def restore(
        self, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor], batch: MoveBatch, fetched
    ) -> None:
        """Write ``fetched`` (``fetch(batch)``) into pool slots ``batch.dst`` (global): after the step's moves."""
        if not len(batch):
            return
        if self.cuda and self._fetched is not None:
            torch.cuda.current_stream(self.device).wait_event(self._fetched)
            for got in fetched:
                got.record_stream(torch.cuda.current_stream(self.device))
        at = self._positions(kv_caches[0], batch.dst)
        for kv, got in zip(kv_caches, fetched):
            kv.view(-1)[at] = got
        dst = torch.as_tensor(batch.dst, dtype=torch.long, device=self.device)
        for pool_t, got in zip(extra, fetched[len(self.kv) :]):
            pool_t[dst] = got
        self.bytes_moved += sum(t[:1].numel() * t.element_size() for t in self.kv) * len(batch)

    # ------------------------------------------------------------------ the joint window
    def begin(self, rows: list[tuple[int, int, np.ndarray]]) -> None:
        """This step's last chunks with parked tokens: (batch row, its window's queries, its tier slots)."""
        if rows:
            self._land()
        self._rows = rows
        self._w: dict[int, torch.Tensor] = {}
        self._where: dict[int, tuple[np.ndarray, int]] = {}
        self._heads = self._layers = 0

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float, output=None) -> None:
        """One attention layer (after it wrote its KV and computed its attention into ``output``): each joint row's
        chunk attends its live keys (causal) and every parked key in one softmax, written over the row's rows of
        ``output`` (``attend``; None: the window's statistics only), and the window's weights are kept."""
        if not self._rows:
            return
        layer = self._layer.get(kv_cache.data_ptr())
        if layer is None:
            return
        for row, n_q, tier_slots in self._rows:
            seq, start, end = int(md.seq_lens[row]), int(md.query_start_loc[row]), int(md.query_start_loc[row + 1])
            if output is None or not self.attend:
                start = end - n_q  # the window alone
            table = md.block_table[row].cpu().numpy()
            live = to_global_slots(np.arange(seq), table, self.bs)
            kv_live = kv_cache.view(-1)[self._positions(kv_cache, live)]  # [seq, kvh, 2 * head_size], as stored
            kv_live = self.fmt.kv(kv_live, layer, self.head_size)
            pos = torch.arange(seq - (end - start), seq, device=kv_cache.device)  # each query's physical position
            out, w = joint_attention(
                query[start:end], kv_live, self._parked(layer, tier_slots, kv_cache.device, end - start,
                query.shape[1]), pos, scale, n_q, self.head_size)  # fmt: skip
            if output is not None and self.attend:
                output[start:end].view(out.shape).copy_(out.to(output.dtype))
            self._w[row] = self._w.get(row, 0) + w
            self._where[row] = (pos[-n_q:].cpu().numpy(), live)
        self._heads = query.shape[1]
        self._layers += 1

    def _parked(self, layer: int, tier_slots: np.ndarray, device: torch.device, queries: int, heads: int):
        """The parked tokens' K and V of one layer, in slices whose logits stay under ``SLICE_BYTES``."""
        step = max(self.MIN_SLICE, self.SLICE_BYTES // max(4 * queries * heads, 1))
        idx = torch.as_tensor(tier_slots, dtype=torch.long)
        for i in range(0, idx.numel(), step):
            part = self.kv[layer][idx[i : i + step]]
            part = part.pin_memory().to(device, non_blocking=True) if self.cuda else part
            yield self.fmt.kv(part, layer, self.head_size)

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
                tier_t[tier] = value[seq:].to(tier_t.dtype).cpu()
        self._rows = []

    def export(self, tier_slots: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The parked slots' statistics, as ``parked:<name>`` (aligned with ``tier_slots``)."""
        idx = torch.as_tensor(tier_slots, dtype=torch.long)
        src = dict(zip((ATTN_SUM, ATTN_HIST), self.extra))
        return {f"parked:{n}": src[n][idx.to(src[n].device)].cpu().numpy() for n in names}


def joint_attention(
    q: torch.Tensor,
    kv_live: torch.Tensor,
    parked,
    pos: torch.Tensor,
    scale: float,
    n_window: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk's queries over its live keys (causal) and parked keys (all earlier), in one softmax.

    ``q`` [Q, H, D] (after RoPE, as the layer computed it); ``kv_live`` [S, KVH, 2D] the request's live tokens in
    physical order (K then V); ``parked``: an iterable of [P_i, KVH, 2D] slices of its parked tokens; ``pos`` [Q]
    each query's physical position (it sees live keys 0..pos). The slices are folded one after another with an
    online softmax (a running maximum and sum, as FlashAttention and vLLM's ``merge_attn_states`` combine partial
    attentions), so the parked keys may stream in from host memory a slice at a time.

    Returns the output [Q, H, D] (float32) and the last ``n_window`` queries' weights summed over heads
    [n_window, S + P] (live keys first, then the parked ones in order)."""
    n, heads, d = q.shape
    kvh = kv_live.shape[1]
    qg = q.float().reshape(n, kvh, heads // kvh, d)
    m = torch.full(qg.shape[:3], float("-inf"), device=q.device)
    total = torch.zeros(qg.shape[:3], device=q.device)
    acc = torch.zeros(n, kvh, heads // kvh, head_size, device=q.device)
    window = []

    def fold(kv: torch.Tensor, future: torch.Tensor | None) -> None:
        nonlocal m, total, acc
        kv = kv.float()
        logits = torch.einsum("qkgd,skd->qkgs", qg, kv[..., :head_size]) * scale
        if future is not None:
            logits = logits.masked_fill(future[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, logits.amax(-1))
        p = torch.exp(logits - m_new[..., None])
        rescale = torch.exp(m - m_new)
        total = total * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("qkgs,skd->qkgd", p, kv[..., head_size:])
        m = m_new
        window.append(logits[n - n_window :])

    keys = torch.arange(kv_live.shape[0], device=q.device)
    fold(kv_live, keys[None, :] > pos[:, None])
    for kv in parked:
        fold(kv, None)
    out = (acc / total[..., None]).reshape(n, heads, head_size)
    lse = (m + torch.log(total))[n - n_window :, ..., None]
    weights = torch.cat([torch.exp(w - lse) for w in window], dim=-1).sum(dim=(1, 2))
    return out, weights
