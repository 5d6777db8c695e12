"""KV mover: applies one engine step's compaction moves to the KV cache tensors (worker side).

All moves of a step - every request, every layer - are applied as ONE gather followed by ONE scatter.
The scheduler may hand a block freed by request A to request B in the same step; if A's tokens were
copied one move at a time, a later move could read a slot that an earlier one already overwrote. Reading
every source before writing any destination makes the result independent of move order.

Slots are global: ``slot = block_id * block_size + offset``. A ``KVLayout`` turns one layer's cache tensor
into views indexed ``[block, offset, ...]`` so the same code serves every backend:

* ``cpu``   vLLM's CPU attention: ``[num_blocks, num_kv_heads, block_size * 2 * head_size]`` per layer;
            inside a (block, head) the K part is stored TRANSPOSED ``[head_size, block_size]``, followed
            by V ``[block_size, head_size]`` (vllm/v1/attention/backends/cpu_attn.py).
* ``flash`` a plain ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor whose last dim is
            K then V (the CUDA FlashAttention view ``kv.transpose(1, 2).split(head_size, -1)``).
* ``slots`` any per-slot tensor ``[num_blocks * block_size, ...]`` (e.g. attention-score accumulators
            that must travel with their tokens).

A layout no view describes (vLLM's CPU backend with AMX packs bf16 K and V in VNNI pairs) is a
``vtoken.kv_layout.TableLayout``, learned from the backend's own cache write; the mover then gathers and
scatters each token's elements by their positions in the cache.

On CUDA, ``vtoken/fused_mover.py`` applies the same batch with one Triton launch per group of layers (a
second one only for moves whose destination another move reads), and each layer's attention waits only for
its group; CpuMover and ReferenceMover below stay as the CPU path and the reference it is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vtoken.kv_layout import Layout, TableLayout

ViewFn = Callable[[torch.Tensor, int], list[torch.Tensor]]


def _cpu_views(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    nb, heads = kv.shape[0], kv.shape[1]
    per_block = kv.reshape(nb, heads, -1)  # a view: vLLM allocates each layer contiguously
    head_size = per_block.shape[-1] // (2 * block_size)
    k_t = per_block[..., : head_size * block_size].view(nb, heads, head_size, block_size)
    v = per_block[..., head_size * block_size :].view(nb, heads, block_size, head_size)
    return [k_t.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)]  # both [nb, block_size, heads, head_size]


def _flash_views(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    return [kv.transpose(1, 2)]  # [nb, block_size, heads, 2 * head_size]


def _slot_views(t: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    return [t.view(t.shape[0] // block_size, block_size, *t.shape[1:])]


LAYOUTS: dict[str, ViewFn] = {"cpu": _cpu_views, "flash": _flash_views, "slots": _slot_views}


@dataclass(frozen=True)
class MoveBatch:
    """One step's moves for all requests, as global slots. Picklable; crosses scheduler -> worker."""

    src: np.ndarray  # int64[n]
    dst: np.ndarray  # int64[n]

    def __post_init__(self) -> None:
        if self.src.shape != self.dst.shape or self.src.ndim != 1:
            raise ValueError(f"src {self.src.shape} and dst {self.dst.shape} must be equal 1-D shapes")

    def __len__(self) -> int:
        return int(self.src.size)

    @staticmethod
    def concat(batches: Sequence[MoveBatch]) -> MoveBatch:
        if not batches:
            return MoveBatch(np.empty(0, np.int64), np.empty(0, np.int64))
        return MoveBatch(
            np.concatenate([b.src for b in batches]).astype(np.int64),
            np.concatenate([b.dst for b in batches]).astype(np.int64),
        )

    def check(self) -> None:
        """Destinations must be distinct: two moves into one slot would race."""
        if np.unique(self.dst).size != self.dst.size:
            raise ValueError("two moves write the same destination slot")


def _views(tensors: Sequence[torch.Tensor], layout: str, block_size: int) -> list[torch.Tensor]:
    try:
        fn = LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown KV layout {layout!r}; known: {sorted(LAYOUTS)}") from None
    return [v for t in tensors for v in fn(t, block_size)]


def _split(kv_caches: Sequence[torch.Tensor], layout: Layout, block_size: int):
    """(views indexed [block, offset, ...], caches moved through a TableLayout's positions)."""
    if isinstance(layout, TableLayout):
        return [], list(kv_caches)
    return _views(kv_caches, layout, block_size), []


class CpuMover:
    """Applies a MoveBatch with one vectorised gather and one scatter per view, on the calling thread."""

    def __init__(self, block_size: int, layout: Layout = "cpu") -> None:
        self.block_size = block_size
        self.layout = layout
        self.bytes_moved = 0

    def _index(self, slots: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.as_tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        return s // self.block_size, s % self.block_size

    def _move(self, views: list[torch.Tensor], tables: list[torch.Tensor], batch: MoveBatch) -> None:
        device = (views or tables)[0].device
        sb, so = self._index(batch.src, device)
        db, do = self._index(batch.dst, device)
        pos: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per cache shape (every layer shares one)
        for t in tables:
            if t.shape not in pos:
                pos[t.shape] = (self.layout.positions(t, sb, so), self.layout.positions(t, db, do))
        gathered = [v[sb, so] for v in views]  # gather everything first ...
        taken = [t.view(-1)[pos[t.shape][0]] for t in tables]
        for v, g in zip(views, gathered):  # ... then scatter
            v[db, do] = g
        for t, g in zip(tables, taken):
            t.view(-1)[pos[t.shape][1]] = g
        self.bytes_moved += sum(g.numel() * g.element_size() for g in gathered + taken)

    def apply(self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()) -> None:
        """Move the KV of ``batch.src`` to ``batch.dst`` in every layer, and in each per-slot ``extra``."""
        if len(batch) == 0:
            return
        views, tables = _split(kv_caches, self.layout, self.block_size)
        self._move(views + _views(extra, "slots", self.block_size), tables, batch)


class CudaMover(CpuMover):
    """Runs the moves on a side CUDA stream after the forward; the next forward waits on ``event``.

    The unfused mover: two indexing kernels and their temporaries per view and layer, and one host wait per
    step for its pinned buffers. ``make_mover`` picks ``vtoken.fused_mover.FusedMover`` where it can; this one
    stays for other layouts and as the benchmark's "today" line.

    The side stream first waits for the compute stream (the forward that wrote this step's KV), so it never
    reads KV that is still being written; the compute stream later waits for ``event`` before attention
    reads the moved slots. The CPU never blocks.
    """

    def __init__(self, block_size: int, layout: Layout = "flash", device: torch.device | str = "cuda") -> None:
        super().__init__(block_size, layout)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.event: torch.cuda.Event | None = None
        self._keepalive: list[torch.Tensor] = []

    def _index(self, slots: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.as_tensor(slots, dtype=torch.long).pin_memory()
        self._keepalive.append(host)  # the async H2D copy reads it after we return
        s = host.to(device, non_blocking=True)
        return s // self.block_size, s % self.block_size

    def apply(
        self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()
    ) -> torch.cuda.Event | None:
        if len(batch) == 0:
            return self.event
        self.wait_host()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            super().apply(kv_caches, batch, extra)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        return self.event

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for the last moves. Non-blocking for the CPU."""
        if self.event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self.event)

    def wait_host(self) -> None:
        """Block the CPU until the last moves finished; frees the pinned index buffers."""
        if self.event is not None:
            self.event.synchronize()
        self._keepalive.clear()

    wait_unhooked = wait  # no per-layer hooks: the forward waits for every move (FusedMover's API)


class ReferenceMover:
    """Plain per-move reference for tests: copies every source token out, then writes each one back."""

    def __init__(self, block_size: int, layout: Layout = "cpu") -> None:
        self.block_size = block_size
        self.layout = layout

    def apply(self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()) -> None:
        views, tables = _split(kv_caches, self.layout, self.block_size)
        views += _views(extra, "slots", self.block_size)
        bs = self.block_size

        def at(t: torch.Tensor, s) -> torch.Tensor:  # one token's elements in a table-layout cache
            b, o = torch.tensor([int(s) // bs]), torch.tensor([int(s) % bs])
            return self.layout.positions(t, b, o).flatten()

        saved = [[v[int(s) // bs, int(s) % bs].clone() for s in batch.src] for v in views]
        saved_t = [[t.view(-1)[at(t, s)].clone() for s in batch.src] for t in tables]
        for v, tokens in zip(views, saved):
            for d, tok in zip(batch.dst, tokens):
                v[int(d) // bs, int(d) % bs] = tok
        for t, tokens in zip(tables, saved_t):
            for d, tok in zip(batch.dst, tokens):
                t.view(-1)[at(t, d)] = tok


def graph_safe_events() -> bool:
    """Whether torch's CUDA events can be waited on inside a captured CUDA graph (``Event(external=True)``: the
    wait becomes an event-wait node for work recorded outside the graph)."""
    import inspect

    return "external" in inspect.signature(torch.cuda.Event.__new__).parameters


def make_mover(device: torch.device | str, block_size: int, layout: Layout | None = None):
    """The mover for a device: on CUDA the fused mover (``vtoken/fused_mover.py``: Triton, a few launches a step,
    an event per layer group) for the FlashAttention layout, today's side-stream CudaMover for a layout whose
    tokens are not rows of contiguous elements or where Triton is missing; the batched CpuMover elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        layout = layout or "flash"
        if layout == "flash":
            try:
                from vtoken.fused_mover import FusedMover
            except ImportError:  # no Triton: the unfused mover still runs
                return CudaMover(block_size, layout, device)
            return FusedMover(block_size, layout, device)
        return CudaMover(block_size, layout, device)
    return CpuMover(block_size, layout or "cpu")
