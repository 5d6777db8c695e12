"""AttentionScorer: the attention statistics H2O and Scissorhands need, per physical KV slot, on the device.

Before each forward the model runner names the batch rows to observe and, for each, how many of the row's
LAST queries (``begin_step``): 1 for a decode row, up to ``w`` for a prefill chunk (SnapKV's observation
window). After every attention layer has written its KV, ``observe`` takes that layer's observed queries;
``end_step`` recomputes their softmax attention over the row's physical slots, sums the step over the TP group
and folds it, query by query, into two per-slot statistics that the mover moves with their tokens
(``extra_tensors``):

  attn_sum  float32 [num_slots]  attention received, summed over layers, ALL heads and observed queries
  attn_hist int64   [num_slots]  shift register; every observed query shifts one bit into each key it
                                 attends to: 1 if the key's share of that query's attention (averaged over
                                 layers and heads) exceeds the uniform share 1 / (p_q + 1)

Query j of a row's last n_q queries sits at physical position ``p_q = seq_len - n_q + j`` and attends to
the row's keys at physical positions 0..p_q (causal, itself included); a decode step is the case n_q = 1.
``vtoken/kv/scores_reference.py`` computes the same numbers the plain way; the tests hold one to the other.

One fast path for every row of the step at once, decode rows and prefill windows alike (no Python work per
request, query or slot). During the forward each layer only hands over its observed queries (a step of decode
rows observes every query of the forward: the layer's query tensor itself, no copy); ``end_step`` then scores
every layer back to back (between two layers the model's weights would push the scorer's small tensors out of
the CPU's caches, which made each of its ops two to three times slower), two tensor ops a layer:

    block table of the observed rows, padded to NB blocks      [R, NB]     NB = blocks of the longest row
    q of every layer's observed queries, by kv head         -> [layers*R*kvh, W*G, D]  (G = heads per kv head;
                                                               one stack for all layers)
    K^T of each (row, kv head), its blocks side by side     -> [R*kvh, D, K]    K = NB * bs; one gather of
                                                               rows of the cache (the CPU layout stores K^T
                                                               per block: bs-element rows as they lie)
    q @ K^T: one bmm                                        -> the step's buffer [layers, R, kvh, W, G, K]
    once per group of layers (all of a decode step's): scale, -inf past each query, softmax over keys (the
    denominator once per row, head and query) summed over layers and heads; over TP ranks once per step, then
    folded query by query

A layer with more than ``_ROWS_BYTES`` of K reads whole K^T blocks in order instead (``_score_by_block``: a
row of every block in turn outruns the CPU's prefetching there), one bmm per block.

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

from vtoken.core.planner import to_global_slots
from vtoken.core.policies import ATTN_HIST, ATTN_SUM
from vtoken.kv.kv_dtype import PLAIN, KvFormat
from vtoken.kv.kv_layout import LAYOUTS, Layout, TableLayout

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
    bias: torch.Tensor  # float32 [R, 1, W, 1, K]: 0 where allowed, -inf elsewhere
    slots: torch.Tensor  # int64 [R*K]: global slot of each key; the trash slot past the row's seq_len
    pos: torch.Tensor  # int64 [R, W]: physical position of each query (padding repeats the last one)
    shift: torch.Tensor  # int64 [R, W]: n_q - 1 - j, where query j's bit ends up in attn_hist
    seq: torch.Tensor  # int64 [R]: physical seq_len of each row
    w: int
    nb: int
    whole: bool  # tok is every token of the forward, in order (a step of decode rows): queries need no gather


class AttentionScorer:
    """Per-slot attention statistics over a paged KV cache (see the module docstring for the semantics).

    ``num_slots = num_blocks * block_size``; slot ``s`` is offset ``s % block_size`` of block
    ``s // block_size``. ``layout`` names one of ``vtoken.kv.kv_layout.LAYOUTS`` ("cpu": vLLM's CPU backend,
    "flash": the CUDA FlashAttention view) or is a ``vtoken.kv.kv_layout.TableLayout`` (vLLM's CPU backend with
    AMX, bf16: K^T is then gathered element by element from its learned positions). Per step:
    ``reset_slots`` (slots written this step), then ``begin_step``, one ``observe`` per attention layer,
    ``end_step``; ``export`` whenever asked.
    Invariant: with tensor parallelism every rank makes the same calls with the same rows and metadata, so
    ``end_step`` runs the same collective with the same shape everywhere (or none, when nothing is observed).
    """

    _CAUSAL_SLACK = 0  # keys up to p_q + slack are attended; tests plant 1 as a negative control

    def __init__(
        self, num_slots: int, block_size: int, layout: Layout, device: torch.device, tp=None, fmt: KvFormat = PLAIN
    ) -> None:
        if not isinstance(layout, TableLayout) and (layout not in LAYOUTS or layout == "slots"):
            raise ValueError(f"unknown KV layout {layout!r}; known: cpu, flash")
        if num_slots % block_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of block_size {block_size}")
        self.num_slots, self.block_size, self.layout = num_slots, block_size, layout
        self.fmt = fmt  # an fp8 cache is read as fp8 (gathered, then widened to float32) times the layer's k_scale
        self.device = torch.device(device)
        self.tp = tp if tp is not None else _OneRank()
        # One trash slot past the end takes the statistics of padding keys, so folding needs no
        # data-dependent selection (which would synchronise a GPU).
        self._acc = torch.zeros(num_slots + 1, dtype=torch.float32, device=self.device)
        self._hist = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self.acc, self.hist = self._acc[:num_slots], self._hist[:num_slots]
        self._fp32_out_bmm: dict[torch.dtype, bool] = {}  # per half dtype: has torch an fp32-output bmm here?
        self._buffers: dict[str, torch.Tensor] = {}  # work storage that every step reuses (see _scratch)
        self._begin(np.empty(0, np.int64), np.empty(0, np.int64))
        self.rows: np.ndarray = np.empty(0, np.int64)  # rows observed in the last finished step
        self.counts = {"steps": 0, "rows": 0}  # steps scored and the rows among them (tests count them)
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
        self._w: torch.Tensor | None = None  # [R, W, K] probabilities summed over flushed layers and heads
        self._work: dict | None = None  # this step's gather indices and work tensors (see _make_work)
        self._seen: list[tuple] = []  # per observed layer: (its observed queries, its KV cache, scale)
        self._pending = 0  # layers in the work buffer, not yet flushed into _w
        self._scale = 1.0  # their softmax scale
        self._layers = self._heads = 0  # layers observed this step, query heads per layer on this rank

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, scale: float, output=None) -> None:
        """One attention layer, after it wrote its KV: add the observed queries' attention to the step.

        ``query`` [num_tokens, heads, head_size] (this rank's heads); ``kv_cache`` one layer in ``layout``;
        ``attn_metadata`` has vLLM's ``query_start_loc`` [B+1], ``seq_lens`` [B] (physical),
        ``block_table`` [B, max_blocks] and ``max_seq_len``."""
        if not self._rows.size:
            return
        if self._plan is None:
            self._plan = self._make_plan(attn_metadata, query.shape[0])
        # Only the observed queries are taken now. The scoring runs in end_step, every layer back to back: between
        # two layers the model's weights would push the scorer's few small tensors out of the CPU's caches, which
        # made each of its ops two to three times slower. When every query of the forward is observed (a step of
        # decode rows) the layer's query itself is kept: nothing writes to it after its attention.
        q = query if self._plan.whole else torch.index_select(query, 0, self._plan.tok)
        if self.fmt.quantised:  # q . (k8 * k_scale) * scale = q . k8 * (scale * k_scale): the fp8 K is read as stored
            scale, kv_cache = scale * self.fmt.k_scale(kv_cache), self.fmt.view(kv_cache)
        self._seen.append((q, kv_cache, scale))
        self._heads = query.shape[1]

    def _score_layers(self) -> None:
        """Every observed layer: gather K, q @ K^T, scale and mask into the step's buffer; softmax per group."""
        if not self._seen:
            return
        wk = self._work = self._make_work(*self._seen[0][:2])
        if wk["by_block"]:
            for q, kv_cache, scale in self._seen:
                self._score_by_block(wk, q, kv_cache, scale)
        else:
            self._score_rows(wk)
        self._flush()
        self._layers = len(self._seen)

    def _score_rows(self, wk: dict) -> None:
        """One layer at a time: one gather of its K^T rows, one bmm into its place in the step's buffer (the scale
        and the mask go on in ``_flush``, once for a group of layers). Gathering several layers' K at once, from
        vLLM's one KV storage, was slower on CPU: the bmm then read K back from memory, not from the L2 cache."""
        seen, kvh, keys = self._seen, wk["kvh"], self._plan.nb * self.block_size
        per, d, rowlen, kidx = len(self._rows) * kvh, seen[0][0].shape[2], wk["rowlen"], wk["kidx"]
        qs = self._stacked_queries(wk).view(len(seen), per, -1, d).unbind(0)  # per layer [R*kvh, W*G, D]
        k = wk["k"]  # the gathered rows, seen as K^T [R*kvh, D, K]
        kt = k.view(-1, d, keys) if wk["stored_kt"] else k.view(-1, keys, d).transpose(1, 2)
        if "k32" in wk:  # half-precision KV where no fp32-output bmm exists: an fp32 copy of the gathered K
            kt32 = wk["k32"].view(kt.shape)
        outs = wk["masked"].view(wk["masked"].shape[0], per, -1, keys)  # [group, R*kvh, W*G, K]
        for q, (_, kv_cache, scale) in zip(qs, seen):
            if self._pending and scale != self._scale:  # one scale a group of layers
                self._flush()
            self._scale = scale
            torch.index_select(self._k_source(kv_cache, rowlen), 0, kidx, out=k)  # rows (or elements) of the cache
            b = kt32.copy_(kt) if "k32" in wk else kt
            if q.dtype == torch.float32:
                torch.bmm(q, b, out=outs[self._pending])
            else:  # half-precision products with an fp32 result (CUDA)
                outs[self._pending].copy_(torch.bmm(q, b, out_dtype=torch.float32))
            self._next_layer()

    def _stacked_queries(self, wk: dict) -> torch.Tensor:
        """Every observed layer's queries, grouped by kv head: [layers * R*kvh, W*G, D] in the compute dtype."""
        p, kvh = self._plan, wk["kvh"]
        qs = [q for q, _, _ in self._seen]
        heads, d = qs[0].shape[1:]
        q = torch.stack(qs, out=self._scratch("q_all", (len(qs), *qs[0].shape), qs[0].dtype))
        q = q.view(len(qs), len(self._rows), p.w, kvh, heads // kvh, d)
        if p.w > 1:  # [layers, R, W, kvh, G, D] -> [layers, R, kvh, W, G, D]
            q = q.transpose(2, 3).contiguous()
        if q.dtype != wk["compute"]:
            q = q.to(wk["compute"])
        return q.view(-1, p.w * heads // kvh, d)

    def _next_layer(self) -> None:
        self._pending += 1
        if self._pending == self._work["masked"].shape[0]:
            self._flush()

    def _score_by_block(self, wk: dict, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> None:
        """One layer when its K passes ``_ROWS_BYTES``: reading a row of every block in turn would outrun the
        CPU's prefetching, so whole K^T blocks are read in order, each (row, kv head)'s q is repeated for each
        of its blocks, one bmm runs per block, and the masking pass lays each row's keys side by side."""
        d = query.shape[2]
        kt = torch.index_select(self._k_source(kv_cache, wk["rowlen"]), 0, wk["kidx"], out=wk["k"])
        kt = kt.view(-1, d, self.block_size)  # [R*kvh*NB, D, bs]
        if "k32" in wk:
            kt = wk["k32"].view(kt.shape).copy_(kt)
        q = query.reshape(-1, query.shape[1] * d // wk["kvh"])  # [R*W*kvh, G*D] (a copy of a whole query)
        if q.dtype == wk["compute"]:
            q = torch.index_select(q, 0, wk["qidx"], out=wk["q"])
        else:
            q = torch.index_select(q, 0, wk["qidx"]).to(wk["compute"])
        q = q.view(kt.shape[0], -1, d)  # [R*kvh*NB, W*G, D]
        if q.dtype == torch.float32:
            torch.bmm(q, kt, out=wk["logits"])  # [R*kvh*NB, W*G, bs], seen as [R, kvh, W, G, NB, bs] by "logits6"
        else:
            wk["logits"].copy_(torch.bmm(q, kt, out_dtype=torch.float32))
        out = wk["masked"][self._pending].view(wk["logits6"].shape)
        torch.add(wk["bias6"], wk["logits6"], alpha=scale, out=out)
        self._next_layer()

    def _flush(self) -> None:
        """Softmax over keys of the buffered layers at once, summed over layers and heads into ``_w``."""
        n, self._pending = self._pending, 0
        if n:
            # [layers, R, kvh, W, G, K] -> [R, W, K], one dimension at a time: torch's CPU reduction over the
            # three at once is about seven times slower
            x = self._work["masked"][:n]
            if not self._work["by_block"]:  # q @ K^T -> scale * q @ K^T, -inf where not attended: [n, R, kvh, W, G, K]
                torch.add(self._plan.bias, x, alpha=self._scale, out=x)
            probs = torch.ops.aten._softmax.out(x, -1, False, out=self._scratch("probs", x.shape, x.dtype))
            w = probs.sum(0).sum(3).sum(1)
            self._w = w if self._w is None else self._w.add_(w)

    # Work buffers of one step: the layers batched into one softmax hold at most this many bytes of logits.
    _GROUP_BYTES = 8 << 20
    _GROUP_LAYERS = 64
    # K of one layer past this many bytes is read block by block (_score_by_block).
    _ROWS_BYTES = 4 << 20

    def _make_work(self, query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
        """This step's gather indices and work tensors, made once and reused by every layer (fresh tensors per
        layer cost page faults on CPU; per-layer index arithmetic costs dispatches). ``query``: one layer's
        observed queries [R*W, heads, D]."""
        p, bs, dev = self._plan, self.block_size, self.device
        r, d, kv_dtype = len(self._rows), query.shape[2], kv_cache.dtype
        k_bytes = r * kv_cache.shape[1] * d * p.nb * bs * kv_cache.element_size()
        kvh, rows_of, rowlen, stored_kt, by_block = self._k_rows(kv_cache, d, k_bytes > self._ROWS_BYTES)
        g, keys = query.shape[1] // kvh, p.nb * bs
        half = kv_dtype != torch.float32
        if half and kv_dtype not in self._fp32_out_bmm:
            self._fp32_out_bmm[kv_dtype] = _has_fp32_out_bmm(dev, kv_dtype)
        fp32_out = half and self._fp32_out_bmm[kv_dtype] and query.dtype == kv_dtype
        compute = kv_dtype if fp32_out else torch.float32
        kidx = rows_of(p.blocks)  # [R, kvh, ...] rows of the cache's row view, in [R*kvh, D, K] order
        per_layer = r * kvh * p.w * g * keys * 4
        group = max(1, min(self._GROUP_LAYERS, self._GROUP_BYTES // per_layer))
        work = {
            "by_block": by_block,
            "kvh": kvh,
            "rowlen": rowlen,
            "stored_kt": stored_kt,
            "compute": compute,
            "kidx": kidx.flatten(),
            "k": self._scratch("k", (kidx.numel(), rowlen), kv_dtype),
            "masked": self._scratch("masked", (group, r, kvh, p.w, g, keys), torch.float32),
        }
        if half and compute == torch.float32:
            work["k32"] = self._scratch("k32", (r * kvh * d * keys,), torch.float32)
        if by_block:  # see _score_by_block
            n, heads = r * kvh * p.nb, torch.arange(kvh, device=dev)
            logits = self._scratch("logits", (n, p.w * g, bs), torch.float32)
            work["qidx"] = (  # row (r * W + w) * kvh + h of the observed queries' [R*W*kvh, G*D] view
                (torch.arange(r * p.w, device=dev).view(r, 1, 1, p.w) * kvh + heads.view(1, kvh, 1, 1))
                .expand(r, kvh, p.nb, p.w)
                .flatten()
            )
            work["q"] = self._scratch("q", (n * p.w, g * d), compute)
            work["logits6"] = logits.view(r, kvh, p.nb, p.w, g, bs).permute(0, 1, 3, 4, 2, 5)
            work["bias6"] = p.bias.view(r, 1, p.w, 1, p.nb, bs)
            work["logits"] = logits
        return work

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A work tensor over storage kept from step to step (grown by half when too small): a fresh allocation
        every step faults its pages in again, which costs more than the small ops that use it."""
        n, buf = math.prod(shape), self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            grown = int(1.5 * buf.numel()) if buf is not None and buf.dtype == dtype else 0
            buf = self._buffers[name] = torch.empty(max(n, grown), dtype=dtype, device=self.device)
        return buf[:n].view(shape)

    def end_step(self) -> None:
        """Score the step's layers, then fold its attention into ``attn_sum`` and ``attn_hist`` (after the TP
        all-reduce)."""
        if self._rows.size and self._seen:
            self.counts["steps"] += 1
            self.counts["rows"] += int(self._rows.size)
        self._score_layers()
        p, w, total = self._plan, self._w, self._layers * self._heads * self.tp.world
        self.rows, self._seq = self._rows, (p.seq if p is not None else None)
        self._begin(np.empty(0, np.int64), np.empty(0, np.int64))
        if w is None:
            return
        w = self.tp.sum_scores(w)  # [R, W, K]: this rank's heads -> all heads
        if p.w == 1:  # decode rows only: every key before seq_len is attended, the keys past it go to the trash
            self._acc.index_add_(0, p.slots, w.view(-1))
            hot = (w / total > uniform_share(p.pos + 1)[:, :, None]).view(-1)
            self._hist[p.slots] = (self._hist[p.slots] << 1) | hot
            return
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
    def _make_plan(self, md, num_tokens: int) -> _StepPlan:
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
        bias = bias.view(len(self._rows), 1, w, 1, nb * bs)
        # every token of the forward observed, in order: the layers' queries are taken as they are
        whole = md.seq_lens.device.type == "cpu" and tok.numel() == num_tokens
        whole = whole and bool(torch.equal(tok, torch.arange(num_tokens, device=dev)))
        return _StepPlan(tok, blocks, allowed, bias, slots, pos, shift, seq, w, nb, whole)

    def _k_rows(self, kv_cache: torch.Tensor, head_size: int, by_block: bool = False):
        """How to gather one layer's K for the observed rows: (kv heads, ``rows_of(blocks)`` -> int64 rows of
        the row view [R, kvh, ...] in [R*kvh, D, K] order, row length, whether the rows hold K^T, whether the
        rows are whole K^T blocks [R, kvh, NB] instead). ``by_block``: whole blocks where the layout keeps a
        block's K^T in one piece (the CPU layout).

        A layout whose K, per (block, kv head), is a strided [X, Y] block with rows of Y contiguous elements is
        read by whole rows: K^T rows of bs tokens in the CPU layout (X = D), K rows of D elements elsewhere
        (X = bs, transposed for the product). A TableLayout is read element by element at its positions."""
        bs, d, dev = self.block_size, head_size, self.device
        if isinstance(self.layout, TableLayout):
            kvh, chunk = kv_cache.shape[1], 2 * bs * d
            kt = torch.as_tensor(self.layout.k_transposed(), device=dev)  # [D, bs]

            def rows_of(blocks):  # elements [R, kvh, D, NB, bs]
                base = (blocks[:, None, :] * kvh + torch.arange(kvh, device=dev)[None, :, None]) * chunk
                return base[:, :, None, :, None] + kt[None, None, :, None, :]

            return kvh, rows_of, 1, True, False
        k = LAYOUTS[self.layout](kv_cache, bs)[0][..., :d].permute(0, 2, 1, 3)  # [nb, kvh, bs, D]
        stored_kt = k.stride(2) == 1 and k.stride(3) != 1  # the CPU layout stores K^T per block
        src = k.transpose(2, 3) if stored_kt else k  # [nb, kvh, X, Y] in memory order
        kvh, rowlen = src.shape[1], src.shape[3]
        st, off = src.stride(), src.storage_offset() - kv_cache.storage_offset()
        if st[3] != 1 or any(x % rowlen for x in (*st[:3], off)):
            raise ValueError(f"KV layout {self.layout!r} has no rows of K the scorer can gather")
        x = torch.arange(src.shape[2], device=dev)
        heads = torch.arange(kvh, device=dev)
        block = src.shape[2] * rowlen  # elements of one (block, kv head)'s K^T when it lies in one piece
        if by_block and stored_kt and st[2] == rowlen and not any(v % block for v in (st[0], st[1], off)):

            def blocks_of(blocks):  # whole K^T blocks [R, kvh, NB]
                return (blocks[:, None, :] * st[0] + heads[None, :, None] * st[1] + off) // block

            return kvh, blocks_of, block, True, True

        r0, r1, r2, roff = (v // rowlen for v in (st[0], st[1], st[2], off))  # all multiples of rowlen (above)

        def rows_of(blocks):  # rows [R, kvh, X, NB] (K^T: D rows per block) or [R, kvh, NB, X] (K: bs rows)
            b = blocks[:, None, None, :] if stored_kt else blocks[:, None, :, None]
            xx = x[None, None, :, None] if stored_kt else x[None, None, None, :]
            return b * r0 + heads[None, :, None, None] * r1 + xx * r2 + roff

        return kvh, rows_of, rowlen, stored_kt, False

    @staticmethod
    def _k_source(kv_cache: torch.Tensor, rowlen: int) -> torch.Tensor:
        """The cache as rows of ``rowlen`` elements (a view: vLLM allocates each layer contiguously)."""
        return kv_cache.view(-1, rowlen)


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
