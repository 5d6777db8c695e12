"""AttentionScorer: the attention statistics H2O and Scissorhands need, per physical KV slot, on the device.

Before each forward the model runner names the batch rows to observe and, for each, how many of the row's
LAST queries (``begin_step``): 1 for a decode row, up to ``w`` for a prefill chunk (SnapKV's observation
window). After every attention layer has written its KV, ``observe`` recomputes those queries' softmax
attention over the row's physical slots. ``end_step`` sums the step over the TP group and folds it, query by
query, into two per-slot statistics that the mover moves with their tokens (``extra_tensors``):

  attn_sum  float32 [num_slots]  attention received, summed over layers, ALL heads and observed queries
  attn_hist int64   [num_slots]  shift register; every observed query shifts one bit into each key it
                                 attends to: 1 if the key's share of that query's attention (averaged over
                                 layers and heads) exceeds the uniform share 1 / (p_q + 1)

Query j of a row's last n_q queries sits at physical position ``p_q = seq_len - n_q + j`` and attends to
the row's keys at physical positions 0..p_q (causal, itself included); a decode step is the case n_q = 1.
``vtoken/scores_reference.py`` computes the same numbers the plain way; the tests hold one to the other.

One fast path for every row of the step at once, decode rows and prefill windows alike (no Python work per
request, query or slot; per layer seven tensor ops into buffers reused by every layer of the step):

    block table of the observed rows, padded to NB blocks     [R, NB]     NB = blocks of the longest row
    K^T of those blocks, one gather of whole (block, head)  -> [R*kvh*NB, D, bs]  (the CPU layout stores
                                                               K^T per block: copied as it lies)
    q of each (row, kv head), repeated per block            -> [R*kvh*NB, W*G, D]  (G = heads per kv head)
    logits = q @ K^T, one bmm, fp32 accumulation            -> [R*kvh*NB, W*G, bs]
    * scale, -inf past each query, keys made contiguous     -> [R, kvh, W, G, NB*bs]   (one op)
    softmax over keys (denominator once per row, head and query), summed over layers in the step's buffer;
    over heads and TP ranks once per step, then folded query by query in ``end_step``

Padding: rows shorter than NB blocks and queries past a row's n_q are computed and then masked (bias -inf,
statistics routed to a trash slot past ``num_slots``); the waste is bounded by the longest observed row.
Slots shared by two rows of one step (a cached prefix) get both rows' ``attn_sum``; their ``attn_hist`` is
one row's (undefined which). The scheduler never evicts shared tokens, so neither reaches a decision.
Not supported (not used by the models we serve): ALiBi, soft-capping, sliding windows, attention sinks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from vtoken.kv_layout import Layout, TableLayout
from vtoken.mover import LAYOUTS
from vtoken.planner import to_global_slots
from vtoken.policies import ATTN_HIST, ATTN_SUM

_HIST_BITS = 64


class _OneRank:
    """Stand-in for ``vllm_adapter.tp.TensorParallel`` without tensor parallelism (no vLLM import)."""

    world = 1

    def sum_scores(self, w: torch.Tensor) -> torch.Tensor:
        return w


class _StepPlan(NamedTuple):
    """This step's observed rows, resolved against the attention metadata once (every layer shares it).

    R rows, W = max n_q (queries padded to W), NB blocks per row (padded), K = NB * block_size keys.
    """

    tok: torch.Tensor  # int64 [R*W]: token index of each observed query in the layer's ``query``
    blocks: torch.Tensor  # int64 [R, NB]: the rows' block tables, padded
    allowed: torch.Tensor  # bool [R, W, K]: key k is at or before query w (and w is a real query)
    bias: torch.Tensor  # float32 [R, 1, W, 1, NB, bs]: 0 where allowed, -inf elsewhere
    slots: torch.Tensor  # int64 [R*K]: global slot of each key; the trash slot past the row's seq_len
    pos: torch.Tensor  # int64 [R, W]: physical position of each query (padding repeats the last one)
    shift: torch.Tensor  # int64 [R, W]: n_q - 1 - j, where query j's bit ends up in attn_hist
    seq: torch.Tensor  # int64 [R]: physical seq_len of each row
    w: int
    nb: int


class AttentionScorer:
    """Per-slot attention statistics over a paged KV cache (see the module docstring for the semantics).

    ``num_slots = num_blocks * block_size``; slot ``s`` is offset ``s % block_size`` of block
    ``s // block_size``. ``layout`` names one of ``vtoken.mover.LAYOUTS`` ("cpu": vLLM's CPU backend,
    "flash": the CUDA FlashAttention view) or is a ``vtoken.kv_layout.TableLayout`` (vLLM's CPU backend with
    AMX, bf16: K^T is then gathered element by element from its learned positions). Per step:
    ``reset_slots`` (slots written this step), then ``begin_step``, one ``observe`` per attention layer,
    ``end_step``; ``export`` whenever asked.
    Invariant: with tensor parallelism every rank makes the same calls with the same rows and metadata, so
    ``end_step`` runs the same collective with the same shape everywhere (or none, when nothing is observed).
    """

    _CAUSAL_SLACK = 0  # keys up to p_q + slack are attended; tests plant 1 as a negative control

    def __init__(self, num_slots: int, block_size: int, layout: Layout, device: torch.device, tp=None) -> None:
        if not isinstance(layout, TableLayout) and (layout not in LAYOUTS or layout == "slots"):
            raise ValueError(f"unknown KV layout {layout!r}; known: cpu, flash")
        if num_slots % block_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of block_size {block_size}")
        self.num_slots, self.block_size, self.layout = num_slots, block_size, layout
        self.device = torch.device(device)
        self.tp = tp if tp is not None else _OneRank()
        # One trash slot past the end takes the statistics of padding keys, so folding needs no
        # data-dependent selection (which would synchronise a GPU).
        self._acc = torch.zeros(num_slots + 1, dtype=torch.float32, device=self.device)
        self._hist = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self.acc, self.hist = self._acc[:num_slots], self._hist[:num_slots]
        self._fp32_out_bmm: dict[torch.dtype, bool] = {}  # per half dtype: has torch an fp32-output bmm here?
        self._views: dict[tuple, tuple] = {}  # per KV cache tensor: its K views (see _k_source)
        self._begin(np.empty(0, np.int64), np.empty(0, np.int64))
        self.rows: np.ndarray = np.empty(0, np.int64)  # rows observed in the last finished step
        self._seq: torch.Tensor | None = None  # and their physical seq_lens

    @property
    def extra_tensors(self) -> list[torch.Tensor]:
        """Per-slot state the KV mover moves with its tokens: [attn_sum, attn_hist], each [num_slots]."""
        return [self.acc, self.hist]

    # ------------------------------------------------------------------ the step
    def reset_slots(self, slots: torch.Tensor) -> None:
        """Global slots written this step start with no history (called before the forward)."""
        self.acc[slots] = 0
        self.hist[slots] = 0

    def begin_step(self, rows, n_queries) -> None:
        """Observe batch ``rows`` (int64 [R]) this step, each through its last ``n_queries[i]`` queries
        (1 for a decode row; at most the row's query length). Rows not listed are not observed at all."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n_queries = np.asarray(n_queries, dtype=np.int64).reshape(-1)
        if rows.shape != n_queries.shape:
            raise ValueError(f"rows {rows.shape} and n_queries {n_queries.shape} differ in shape")
        if n_queries.size and n_queries.min() < 1:
            raise ValueError("every observed row needs at least one query")
        self._begin(rows, n_queries)

    def _begin(self, rows: np.ndarray, n_queries: np.ndarray) -> None:
        self._rows, self._nq = rows, n_queries
        self._plan: _StepPlan | None = None
        self._w5: torch.Tensor | None = None  # [R, kvh, W, G, K] probabilities summed over layers
        self._work: dict | None = None  # this step's gather indices and work tensors (see _make_work)
        self._layers = self._heads = 0  # layers observed this step, query heads per layer on this rank

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, scale: float) -> None:
        """One attention layer, after it wrote its KV: add the observed queries' attention to the step.

        ``query`` [num_tokens, heads, head_size] (this rank's heads); ``kv_cache`` one layer in ``layout``;
        ``attn_metadata`` has vLLM's ``query_start_loc`` [B+1], ``seq_lens`` [B] (physical),
        ``block_table`` [B, max_blocks] and ``max_seq_len``."""
        if not self._rows.size:
            return
        if self._plan is None:
            self._plan = self._make_plan(attn_metadata)
        src, flat, stored_kt = self._k_source(kv_cache, query.shape[2])
        self._kv_heads = kvh = src.shape[1] if src is not None else kv_cache.shape[1]
        if self._work is None:
            self._work = self._make_work(query, src, kv_cache.dtype)
        wk = self._work
        # K (stored K^T on CPU) of every observed row's blocks: one gather of whole (block, kv head) chunks.
        if "kpos" in wk:  # a table layout: K^T element by element, from its positions in the cache
            kt = torch.index_select(kv_cache.view(-1), 0, wk["kpos"], out=wk["k"].view(-1)).view(wk["k"].shape)
        elif flat is not None:
            kt = torch.index_select(flat, 0, wk["kidx"], out=wk["k"])
        else:  # a layout whose heads do not nest inside blocks
            kt = src[wk["blocks"], torch.arange(kvh, device=self.device)[None, :, None]].flatten(0, 2)
        kt = kt if stored_kt else kt.transpose(1, 2)  # [N, D, bs]
        if "k32" in wk:  # half-precision KV where no fp32-output bmm exists: an fp32 copy of the gathered blocks
            kt = wk["k32"].copy_(kt)
        # q of each (row, kv head), repeated for each of the row's blocks (the one copy a block-batched bmm
        # needs): the observed tokens' rows, then their (token, kv head) rows in the bmm's layout
        # [R, kvh, NB, W, G*D] = [N, W*G, D]; two plain index_selects (advanced indexing costs 4x here).
        q = torch.index_select(query, 0, self._plan.tok)  # [R*W, heads, D], contiguous
        q = q.view(-1, q.shape[1] * q.shape[2] // kvh)
        if q.dtype == wk["compute"]:
            q = torch.index_select(q, 0, wk["qidx"], out=wk["q"])
        else:
            q = torch.index_select(q, 0, wk["qidx"]).to(wk["compute"])
        q = q.view(kt.shape[0], -1, query.shape[2])
        if q.dtype == torch.float32:
            torch.bmm(q, kt, out=wk["logits"])  # [N, W*G, bs], seen as [R, kvh, W, G, NB, bs] by "logits6"
        else:
            wk["logits"].copy_(torch.bmm(q, kt, out_dtype=torch.float32))
        # One pass: * scale, -inf where not attended, and each row's keys made contiguous for the softmax.
        torch.add(self._plan.bias, wk["logits6"], alpha=scale, out=wk["masked"])
        probs = torch.softmax(wk["masked5"], dim=-1)  # [R, kvh, W, G, K]
        if self._w5 is None:
            self._w5 = probs
        else:
            self._w5.add_(probs)
        self._layers += 1
        self._heads = query.shape[1]

    def _make_work(self, query: torch.Tensor, src: torch.Tensor, kv_dtype) -> dict:
        """This step's gather indices and work tensors, made at its first layer and reused by every layer
        (fresh tensors per layer cost page faults on CPU; per-layer index arithmetic costs dispatches)."""
        p, bs, dev = self._plan, self.block_size, self.device
        r, kvh, d = len(self._rows), self._kv_heads, query.shape[2]
        g, n = query.shape[1] // kvh, r * kvh * p.nb
        half = kv_dtype != torch.float32
        if half and kv_dtype not in self._fp32_out_bmm:
            self._fp32_out_bmm[kv_dtype] = _has_fp32_out_bmm(dev, kv_dtype)
        fp32_out = half and self._fp32_out_bmm[kv_dtype] and query.dtype == kv_dtype
        compute = kv_dtype if fp32_out else torch.float32
        heads = torch.arange(kvh, device=dev)
        logits = torch.empty(n, p.w * g, bs, dtype=torch.float32, device=dev)
        masked = torch.empty(r, kvh, p.w, g, p.nb, bs, dtype=torch.float32, device=dev)
        work = {
            "compute": compute,
            "blocks": p.blocks[:, None, :],
            "kidx": (p.blocks[:, None, :] * kvh + heads[None, :, None]).flatten(),  # rows of [blocks * kvh, ...]
            # (block, kv head) in memory order; K^T [D, bs] for a table layout
            "k": torch.empty(n, *(src.shape[2:] if src is not None else (d, bs)), dtype=kv_dtype, device=dev),
            "qidx": (torch.arange(r * p.w, device=dev).view(r, 1, 1, p.w) * kvh + heads.view(1, kvh, 1, 1))
            .expand(r, kvh, p.nb, p.w)
            .flatten(),  # row (r * W + w) * kvh + h of the observed queries' [R*W*kvh, G*D] view
            "q": torch.empty(n * p.w, g * d, dtype=compute, device=dev),
            "logits": logits,
            "logits6": logits.view(r, kvh, p.nb, p.w, g, bs).permute(0, 1, 3, 4, 2, 5),
            "masked": masked,
            "masked5": masked.view(r, kvh, p.w, g, p.nb * bs),
        }
        if half and compute == torch.float32:
            work["k32"] = torch.empty(n, d, bs, dtype=torch.float32, device=dev)
        if isinstance(self.layout, TableLayout):
            chunk = 2 * bs * d
            kt = torch.as_tensor(self.layout.k_transposed(), device=dev).flatten()
            work["kpos"] = (work["kidx"][:, None] * chunk + kt[None, :]).flatten()
        return work

    def end_step(self) -> None:
        """Fold this step's attention into ``attn_sum`` and ``attn_hist`` (after the TP all-reduce)."""
        p, w5, total = self._plan, self._w5, self._layers * self._heads * self.tp.world
        self.rows, self._seq = self._rows, (p.seq if p is not None else None)
        self._begin(np.empty(0, np.int64), np.empty(0, np.int64))
        if w5 is None:
            return
        w = self.tp.sum_scores(w5.sum((1, 3)))  # [R, W, K]: this rank's heads -> all heads
        w = w.masked_fill(~p.allowed, 0.0)  # padding queries, and keys after each query
        self._acc.index_add_(0, p.slots, w.sum(1).flatten())
        share = w / total
        hot = (share > uniform_share(p.pos + 1)[:, :, None]) & p.allowed
        keep = p.shift < _HIST_BITS  # a window longer than the register: the oldest bits fall off
        bits = (hot & keep[:, :, None]).long() << p.shift.clamp(max=_HIST_BITS - 1)[:, :, None]
        bits = bits.sum(1).flatten()  # distinct powers of two: the sum is the bitwise or
        shifts = p.allowed.sum(1).flatten()  # queries that attended each key, >= 1 for every real key
        old = self._hist[p.slots]
        old = torch.where(shifts >= _HIST_BITS, 0, old << shifts.clamp(max=_HIST_BITS - 1))
        self._hist[p.slots] = old | bits

    @property
    def lens(self) -> np.ndarray:
        """Physical seq_len of each row in ``rows`` (copied to the host only when read)."""
        return np.empty(0, np.int64) if self._seq is None else self._seq.cpu().numpy()

    def export(self, block_ids: list[int], physical_len: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """One request's statistics per physical slot [physical_len], on the host."""
        slots = torch.as_tensor(
            to_global_slots(np.arange(physical_len), block_ids, self.block_size), device=self.acc.device
        )
        src = {ATTN_SUM: self.acc, ATTN_HIST: self.hist}
        return {n: src[n][slots].cpu().numpy() for n in names}

    # ------------------------------------------------------------------ fast-path pieces
    def _make_plan(self, md) -> _StepPlan:
        bs, dev = self.block_size, self.device
        rows = _to_device(self._rows, dev)
        nq = _to_device(self._nq, dev)
        w = int(self._nq.max())
        seq = md.seq_lens.index_select(0, rows).long()
        end = md.query_start_loc.index_select(0, rows + 1).long()
        if md.seq_lens.device.type == "cpu":  # host metadata: exact, and the query lengths can be checked
            longest = int(seq.max())
            qlen = end - md.query_start_loc.index_select(0, rows).long()
            if bool((nq > qlen).any()):
                raise ValueError("a row is asked for more queries than it has this step")
        else:  # device metadata: vLLM's host-side bound, so that nothing waits for the GPU
            longest = int(md.max_seq_len)
        nb = min(-(-longest // bs), md.block_table.shape[1])
        blocks = md.block_table.index_select(0, rows)[:, :nb].long()
        j = torch.arange(w, device=dev)
        real = j[None, :] < nq[:, None]  # [R, W]
        pos = torch.where(real, seq[:, None] - nq[:, None] + j[None, :], seq[:, None] - 1)
        tok = (end[:, None] - seq[:, None] + pos).flatten()  # the row's last token sits at seq - 1
        kpos = torch.arange(nb * bs, device=dev)
        allowed = (kpos[None, None, :] <= pos[:, :, None] + self._CAUSAL_SLACK) & real[:, :, None]
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=dev).masked_fill_(~allowed, -math.inf)
        slots = (blocks[:, :, None] * bs + torch.arange(bs, device=dev)).view(len(self._rows), -1)
        slots = torch.where(kpos[None, :] < seq[:, None], slots, self.num_slots).flatten()
        shift = nq[:, None] - 1 - j[None, :]
        bias = bias.view(len(self._rows), 1, w, 1, nb, bs)
        return _StepPlan(tok, blocks, allowed, bias, slots, pos, shift, seq, w, nb)

    def _k_source(self, kv_cache: torch.Tensor, head_size: int):
        """One layer's K as [blocks, kvh, X, Y] in memory order ((D, bs) for the CPU layout's stored K^T),
        flattened to [blocks * kvh, X, Y] when that is a view. Cached per cache tensor: the views hold the
        tensor's storage, so its address cannot be reused by another tensor while the entry lives."""
        if isinstance(self.layout, TableLayout):
            return None, None, True  # gathered through its positions (see _make_work's "kpos")
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype, head_size)
        hit = self._views.get(key)
        if hit is None:
            k = LAYOUTS[self.layout](kv_cache, self.block_size)[0][..., :head_size]  # [nb, bs, kvh, D]
            k = k.permute(0, 2, 1, 3)  # [nb, kvh, bs, D]
            transposed = k.stride(2) == 1 and k.stride(3) != 1  # the CPU layout stores K^T per block
            src = k.transpose(2, 3) if transposed else k  # copy blocks in their memory order
            try:
                flat = src.view(src.shape[0] * src.shape[1], *src.shape[2:])
            except RuntimeError:
                flat = None
            if len(self._views) > 4096:  # vLLM's caches live as long as the engine; tests make many
                self._views.clear()
            hit = self._views[key] = (src, flat, transposed)
        return hit


def uniform_share(num_attended):
    """The share of a query's attention that a key gets when attention is uniform: 1 / (the number of keys
    the query attends to, itself included). One definition for the scorer, its reference and the quality
    benchmark. For a query at physical position p_q that is p_q + 1, so a decode step (p_q = seq_len - 1)
    is the window's last query; counting live tokens instead would agree only when no slot below p_q is dead."""
    return 1.0 / num_attended


def _has_fp32_out_bmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch multiplies ``dtype`` matrices into an fp32 result on ``device`` (no sync)."""
    if device.type != "cuda":
        return False  # torch's CPU bmm has no out_dtype; there the gathered blocks are upcast instead
    try:
        a = torch.ones(1, 1, 1, dtype=dtype, device=device)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # no host sync
    return t.to(device)
