"""KV movers: apply one engine step's moves (a ``MoveBatch``) to the KV cache tensors. Worker side.

All moves of a step - every request, every layer - are applied as ONE gather followed by ONE scatter.
The scheduler may hand a block freed by request A to request B in the same step; if A's tokens were
copied one move at a time, a later move could read a slot that an earlier one already overwrote. Reading
every source before writing any destination makes the result independent of move order.

Slots are global: ``slot = block_id * block_size + offset``. A layout (``vtoken/kv/kv_layout.py``) turns one layer's
cache tensor into views indexed ``[block, offset, ...]``, or, for a layout no view describes (vLLM's AMX kernel packs
bf16 K and V in VNNI pairs), into each token's element positions.

``Mover`` is the one interface the worker sees. Implementations:

    CpuMover        one vectorised gather and scatter per view, on the calling thread (done when ``apply`` returns)
    CudaMover       the same on a side CUDA stream; the forward's stream waits on an event
    FusedMover      (vtoken/kv/fused_mover.py) one Triton launch per group of layers, an event per group
    ReferenceMover  a plain per-move copy, the reference the others are tested against

``vtoken/kv/mover_factory.py`` picks one for a device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.kv_layout import Layout, split, views


class Mover:
    """Applies MoveBatches to a worker's KV caches and per-slot tensors (``extra``: ``[num_slots, ...]``).

    Ordering contract. After ``apply`` returns, the moves are done (CPU) or queued on a side stream (CUDA). Work on
    the forward's stream that reads or writes moved slots must come after ``wait`` (every move), or, for a mover with
    per-layer events (``per_layer``), after ``wait_layer(i)`` for layer ``i`` and ``wait_unhooked`` for the rest. On
    CPU every wait is a no-op. No wait blocks the CPU except ``wait_host``.

    Invariant: ``bytes_moved`` counts each moved token's bytes (every layer and per-slot tensor) once."""

    per_layer: bool = False  # layers may wait for their own group's moves (vtoken/vllm_adapter/move_waits.py)

    def __init__(self) -> None:
        self.bytes_moved = 0

    def apply(self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()) -> None:
        """Move the KV of ``batch.src`` to ``batch.dst`` in every layer, and in each per-slot ``extra``."""
        raise NotImplementedError

    def bind(self, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> None:
        """Prepare for these tensors once (fixed addresses for CUDA graphs). Nothing to do for most movers."""

    def wait(self, stream=None) -> None:
        """``stream`` (default: the current one) waits for every move of the last step."""

    def wait_unhooked(self, stream=None) -> None:
        """What the forward's stream waits for before the forward when some layers wait for their own moves: the
        per-slot tensors and every layer without a hook. Without per-layer waits: everything."""
        self.wait(stream)

    def wait_layer(self, layer: int, stream=None) -> None:
        """``stream`` waits for layer ``layer``'s moves (``per_layer`` movers; the others wait in ``wait``)."""

    def layer_of(self, kv_cache: torch.Tensor) -> int | None:
        """The bound layer whose cache starts where ``kv_cache`` does; None without per-layer events."""
        return None

    def wait_host(self) -> None:
        """Block the CPU until the last moves finished (tests and benchmarks only)."""


class CpuMover(Mover):
    """Applies a MoveBatch with one vectorised gather and one scatter per view, on the calling thread."""

    def __init__(self, block_size: int, layout: Layout = "cpu") -> None:
        super().__init__()
        self.block_size = block_size
        self.layout = layout

    def _index(self, slots, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.as_tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        return s // self.block_size, s % self.block_size

    def _move(self, vs: list[torch.Tensor], tables: list[torch.Tensor], batch: MoveBatch) -> None:
        device = (vs or tables)[0].device
        sb, so = self._index(batch.src, device)
        db, do = self._index(batch.dst, device)
        pos: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per cache shape (every layer shares one)
        for t in tables:
            if t.shape not in pos:
                pos[t.shape] = (self.layout.positions(t, sb, so), self.layout.positions(t, db, do))
        gathered = [v[sb, so] for v in vs]  # gather everything first ...
        taken = [t.view(-1)[pos[t.shape][0]] for t in tables]
        for v, g in zip(vs, gathered):  # ... then scatter
            v[db, do] = g
        for t, g in zip(tables, taken):
            t.view(-1)[pos[t.shape][1]] = g
        self.bytes_moved += sum(g.numel() * g.element_size() for g in gathered + taken)

    def apply(self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()) -> None:
        if len(batch) == 0:
            return
        vs, tables = split(kv_caches, self.layout, self.block_size)
        self._move(vs + views(extra, "slots", self.block_size), tables, batch)


class CudaMover(CpuMover):
    """Runs the moves on a side CUDA stream after the forward; the next forward waits on ``event``.

    The unfused mover: two indexing kernels and their temporaries per view and layer, and one host wait per
    step for its pinned buffers. ``make_mover`` picks ``vtoken.kv.fused_mover.FusedMover`` where it can; this one
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

    def _index(self, slots, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


class ReferenceMover(Mover):
    """Plain per-move reference for tests: copies every source token out, then writes each one back."""

    def __init__(self, block_size: int, layout: Layout = "cpu") -> None:
        super().__init__()
        self.block_size = block_size
        self.layout = layout

    def apply(self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()) -> None:
        vs, tables = split(kv_caches, self.layout, self.block_size)
        vs += views(extra, "slots", self.block_size)
        bs = self.block_size

        def at(t: torch.Tensor, s) -> torch.Tensor:  # one token's elements in a table-layout cache
            b, o = torch.tensor([int(s) // bs]), torch.tensor([int(s) % bs])
            return self.layout.positions(t, b, o).flatten()

        saved = [[v[int(s) // bs, int(s) % bs].clone() for s in batch.src] for v in vs]
        saved_t = [[t.view(-1)[at(t, s)].clone() for s in batch.src] for t in tables]
        for v, tokens in zip(vs, saved):
            for d, tok in zip(batch.dst, tokens):
                v[int(d) // bs, int(d) % bs] = tok
        for t, tokens in zip(tables, saved_t):
            for d, tok in zip(batch.dst, tokens):
                t.view(-1)[at(t, d)] = tok
        per_token = sum(v[0, 0].numel() * v.element_size() for v in vs)
        per_token += sum(t.shape[1] * self.layout.index.size * t.element_size() for t in tables)
        self.bytes_moved += per_token * len(batch)


def graph_safe_events() -> bool:
    """Whether torch's CUDA events can be waited on inside a captured CUDA graph (``Event(external=True)``: the
    wait becomes an event-wait node for work recorded outside the graph)."""
    import inspect

    return "external" in inspect.signature(torch.cuda.Event.__new__).parameters
