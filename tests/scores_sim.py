"""A small stand-in for the model runner that drives attention scorers the way vLLM's steps would.

Requests prefill in chunks and then decode, in one batch; every step writes the new tokens' KV into a paged
cache (shuffled blocks), resets their slots, observes the chosen rows (a prefill chunk through its last
``window`` queries, a decode row through its one query), and may then evict random tokens and compact the
request with the real planner and mover (statistics move with their tokens through ``extra_tensors``).
Every scorer passed in sees exactly the same calls. The random data is drawn for ALL heads and then sliced,
so a tensor-parallel rank (``rank``/``world``) sees its share of the very numbers a single rank sees.
Only torch, numpy and vToken's vLLM-free modules: the GPU check runs it without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.core.packing import kill_and_pack
from vtoken.core.planner import to_global_slots
from vtoken.core.token_table import TokenTable
from vtoken.kv.kv_layout import LAYOUTS, TableLayout
from vtoken.kv.mover_factory import make_mover
from vtoken.kv.scores import ATTN_HIST, ATTN_SUM
from vtoken.kv.scores_reference import NEAR_TIE


@dataclass
class Req:
    prompt: int  # prompt tokens, prefilled in chunks of ``chunk``
    chunk: int
    window: int  # observed queries of a prefill chunk
    observed: bool = True  # False: a request whose policy needs no scores
    table: TokenTable = None
    blocks: list[int] = field(default_factory=list)


class ScoreSim:
    def __init__(
        self,
        scorers: list,
        reqs: list[Req],
        *,
        layout="cpu",  # a view name or a TableLayout
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        heads: int = 4,
        kv_heads: int = 2,
        head_size: int = 32,
        layers: int = 3,
        block_size: int = 16,
        num_blocks: int = 96,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        qkv_view: bool = False,  # queries as vLLM hands them over: a view into the layer's qkv projection
    ) -> None:
        self.scorers, self.reqs, self.layout, self.device, self.dtype = scorers, reqs, layout, device, dtype
        self.qkv_view = qkv_view
        self.heads, self.kv_heads, self.d, self.layers, self.bs = heads, kv_heads, head_size, layers, block_size
        self.g = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.q_heads = slice(rank * heads // world, (rank + 1) * heads // world)
        self.kv_slice = slice(rank * kv_heads // world, (rank + 1) * kv_heads // world)
        shape = (num_blocks, kv_heads, block_size * 2 * head_size)
        if layout == "flash":
            shape = (num_blocks, kv_heads, block_size, 2 * head_size)
        self.kv = [self._rand(shape)[:, self.kv_slice].to(device, dtype).contiguous() for _ in range(layers)]
        self.free = [int(b) for b in self.rng.permutation(num_blocks)]
        self.mover = make_mover(device, block_size, layout)
        for r in reqs:
            r.table = TokenTable(block_size)
        self.steps = 0

    def _rand(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.g)

    # ------------------------------------------------------------------ one engine step
    def step(self, evict: float = 0.0) -> None:
        rows, n_q, q_lens, new = [], [], [], []
        for i, r in enumerate(self.reqs):
            done = r.table.num_logical
            q_len = min(r.chunk, r.prompt - done) if done < r.prompt else 1
            old = r.table.physical_len
            r.table.append(q_len)
            while len(r.blocks) * self.bs < r.table.physical_len:
                r.blocks.append(self.free.pop())
            new.append(to_global_slots(np.arange(old, r.table.physical_len), r.blocks, self.bs))
            q_lens.append(q_len)
            if r.observed:
                rows.append(i)
                n_q.append(min(r.window, q_len) if done < r.prompt else 1)
        new = np.concatenate(new)
        self._write_kv(new)
        md = self._metadata(q_lens)
        for s in self.scorers:
            s.reset_slots(torch.as_tensor(new, device=self.device))
            s.begin_step(np.array(rows, np.int64), np.array(n_q, np.int64))
        scale = self.d**-0.5
        for layer in range(self.layers):
            q = self._rand((sum(q_lens), self.heads, self.d))[:, self.q_heads].to(self.device, self.dtype)
            if self.qkv_view:  # q, k and v side by side in one row per token, q a strided view
                qkv = torch.zeros(q.shape[0], q.shape[1] + 2 * self.kv_heads, self.d, dtype=q.dtype, device=q.device)
                qkv[:, : q.shape[1]] = q
                q = qkv[:, : q.shape[1]]
            for s in self.scorers:
                s.observe(q, self.kv[layer], md, scale)
        for s in self.scorers:
            s.end_step()
        if evict:
            self._evict_and_compact(evict)
        self.steps += 1

    def _write_kv(self, slots: np.ndarray) -> None:
        """New tokens' K and V, as the attention layer writes them before the scorer reads them."""
        b = torch.as_tensor(slots // self.bs, device=self.device)
        o = torch.as_tensor(slots % self.bs, device=self.device)
        for kv in self.kv:
            if isinstance(self.layout, TableLayout):  # K then V of each token, at their learned positions
                data = self._rand((len(slots), self.kv_heads, 2 * self.d))[:, self.kv_slice]
                kv.view(-1)[self.layout.positions(kv, b, o)] = data.to(self.device, self.dtype)
                continue
            for view in LAYOUTS[self.layout](kv, self.bs):
                data = self._rand((len(slots), self.kv_heads, view.shape[-1]))[:, self.kv_slice]
                view[b, o] = data.to(self.device, self.dtype)

    def _metadata(self, q_lens: list[int]) -> SimpleNamespace:
        """vLLM's attention metadata fields the scorer reads. Block-table rows are padded with real block
        ids of other requests, so a scorer that reads past a row's seq_len reads someone else's keys."""
        width = max(len(r.blocks) for r in self.reqs) + 2
        table = self.rng.integers(0, self.kv[0].shape[0], size=(len(self.reqs), width))
        for i, r in enumerate(self.reqs):
            table[i, : len(r.blocks)] = r.blocks
        seq = [r.table.physical_len for r in self.reqs]
        return SimpleNamespace(
            query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32).to(self.device),
            seq_lens=torch.tensor(seq, dtype=torch.int32).to(self.device),
            block_table=torch.tensor(table, dtype=torch.int32).to(self.device),
            max_seq_len=max(seq),
        )

    def _evict_and_compact(self, fraction: float) -> None:
        """Kill a random ``fraction`` of each request's live tokens (never its newest 4), then pack it."""
        moves = []
        for r in self.reqs:
            live = r.table.live_logical()
            candidates = live[live < r.table.num_logical - 4]
            k = int(fraction * candidates.size)
            if not k:
                continue
            packed = kill_and_pack(r.table, self.rng.choice(candidates, size=k, replace=False), r.blocks, self.bs)
            moves.append(packed.moves)
            self.free += r.blocks[packed.plan.keep_blocks :]
            del r.blocks[packed.plan.keep_blocks :]
        batch = MoveBatch.concat(moves)
        if not len(batch):
            return
        self.mover.apply(self.kv, batch)
        for s in self.scorers:  # each scorer's statistics travel with the tokens, on the scorer's device
            extra = s.extra_tensors
            mover = make_mover(extra[0].device, self.bs, self.layout)
            mover.apply([], batch, extra)
            if hasattr(mover, "wait_host"):
                mover.wait_host()
        if hasattr(self.mover, "wait_host"):
            self.mover.wait_host()

    # ------------------------------------------------------------------ results
    def stats(self, scorer, names=(ATTN_SUM, ATTN_HIST)) -> list[dict[str, np.ndarray]]:
        """Each request's statistics over its live tokens, in logical order (independent of where they sit)."""
        out = []
        for r in self.reqs:
            got = scorer.export(r.blocks, r.table.physical_len, names)
            slots = r.table.slot_of[r.table.live_logical()]
            out.append({n: v[slots] for n, v in got.items()})
        return out


def batch() -> list[Req]:
    """Four requests of different lengths: long chunked prefills, a one-token prompt, an unobserved row."""
    return [
        Req(prompt=70, chunk=32, window=8),
        Req(prompt=1, chunk=8, window=8),
        Req(prompt=45, chunk=45, window=4, observed=False),
        Req(prompt=130, chunk=64, window=16),
    ]


def compare(reqs: list[Req], fast: list[dict], ref: list[dict], rtol: float = 1e-5) -> None:
    """Per-request statistics (``ScoreSim.stats``) of a scorer against the reference's: attn_sum to float
    rounding, attn_hist bit for bit except on slots where the reference saw a near-tie at the threshold."""
    ties = total = 0
    for r, a, b in zip(reqs, fast, ref):
        if not r.observed:
            continue
        np.testing.assert_allclose(a[ATTN_SUM], b[ATTN_SUM], rtol=rtol, atol=1e-6)
        clear = ~b[NEAR_TIE]
        np.testing.assert_array_equal(a[ATTN_HIST][clear], b[ATTN_HIST][clear])
        ties, total = ties + int(b[NEAR_TIE].sum()), total + clear.size
    assert ties <= 0.01 * total, f"{ties} near-ties in {total} slots: too degenerate to check attn_hist"


def assert_same_stats(sim: ScoreSim, fast, ref) -> None:
    compare(sim.reqs, sim.stats(fast), sim.stats(ref, (ATTN_SUM, ATTN_HIST, NEAR_TIE)))
