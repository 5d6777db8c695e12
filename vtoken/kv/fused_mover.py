"""FusedMover: one engine step's moves, every layer and every per-slot tensor, in a fixed handful of launches.

Per step, on a side CUDA stream that first waits for the compute stream (the forward that wrote the KV):

    copy the step's slots, host -> device (one copy into a buffer sized once)
    launch over the per-slot tensors (attention statistics)  -> record events[0]
    launch over layer group 0 (layer 0)                        -> record events[1]
    launch over layer group 1 (layers 1-2)                     -> record events[2]
    ...                                 (groups of 1, 2, 4, ... layers)

so a step issues 1 + log2(layers) launches whatever its batch, layers or tokens (``vtoken/kv/move_kernel.py``),
and a layer's attention waits only for its own group's event (``vtoken/vllm_adapter/move_waits.py``): layer
0 waits for one layer's moves, and each later group, no larger than all the layers before it, moves while
their forward runs. The CPU never waits.

Every source is read before any destination is written, as CpuMover guarantees: the scheduler can hand a
block freed by one request to another in the same step, so a slot can be both read and written by one
batch. A single launch cannot order its programs, so the batch is split on the host: a move whose
destination no move reads goes straight to it (phase 0); a move whose destination is also a source is first
copied into a staging buffer (phase 0) and from there to its destination by a second launch (phase 1), after
every read. Compaction alone never produces such a move (holes are dead, sources live), so the second launch
is rare; self-moves are dropped.

Fixed addresses, for CUDA graphs: the tables, the index buffer (one int32 pair per slot: destinations are
distinct, so a batch fits) and the events are made once per set of tensors (``bind``); a step allocates
nothing, except the staging buffer growing to a batch's staged moves the first time they exceed it. The
events are "external" (torch.cuda.Event(external=True)): a wait on one captured into a CUDA graph waits, at
every replay, for the moves last recorded on it, outside the graph.

On CPU tensors the same kernel runs under Triton's interpreter, without streams (the tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.kv import move_kernel
from vtoken.kv.kv_layout import LAYOUTS
from vtoken.kv.move_kernel import WORDS, Launch
from vtoken.kv.mover import Mover, graph_safe_events


def group_sizes(num_layers: int) -> list[int]:
    """Layers per group, in layer order: 1, 2, 4, ...; what is left after the last power of two forms a group
    of its own, or joins the last one when smaller than half of it (30 layers: 1, 2, 4, 8, 15; 32: 1, 2, 4, 8, 17)."""
    sizes, left = [], num_layers
    while left:
        size = min(1 << len(sizes), left)
        if sizes and size < sizes[-1] // 2:
            sizes[-1] += size
        else:
            sizes.append(size)
        left -= size
    return sizes


class FusedMover(Mover):
    """Applies a MoveBatch to bound KV caches (``layout``: "flash", the CUDA FlashAttention cache) and per-slot
    tensors with at most two launches per layer group. See the module docstring for the order of work.

    ``apply`` binds the tensors it is given the first time (and again only if they change); KV caches are
    ``[num_blocks, kv_heads, block_size, 2 * head_size]``, per-slot tensors ``[num_slots, ...]``. After
    ``apply`` the caller makes its streams wait: ``wait`` (everything), ``wait_layer(i)``, ``wait_extras``.
    Invariant: ``bytes_moved`` counts each moved token's bytes once, staged or not.
    """

    _MAX_TOK = 64  # moves per program (planted-bug tests lower it to 1)
    per_layer = True

    def __init__(
        self,
        block_size: int,
        layout: str = "flash",
        device: torch.device | str = "cuda",
        group_sizes: Sequence[int] | None = None,
    ) -> None:
        if layout not in LAYOUTS or layout == "slots":
            raise ValueError(f"unknown KV layout {layout!r} for the fused mover")
        self.block_size, self.layout, self.device = block_size, layout, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._sizes = list(group_sizes) if group_sizes is not None else None
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.bytes_moved = 0
        self.launches = 0  # kernel launches issued
        self.staged = 0  # moves that went through the staging buffer
        self.host_waits = 0  # times the CPU waited for a host index buffer (never, with one step in flight)
        self.hooked: set[int] = set()  # layers whose attention waits for their own group (move_waits.install)
        self._bound: tuple = ()
        self._stage_tokens = 0

    # ------------------------------------------------------------------ binding (allocates)
    def bind(self, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> None:
        """Build the launch tables, the index buffers and the events for these tensors."""
        kv, extra = list(kv_caches), list(extra)
        bs, dev = self.block_size, self.device
        if any(t.device != dev for t in kv + extra):
            raise ValueError(f"every tensor must be on {dev}")
        sizes = self._sizes or group_sizes(len(kv))
        if sum(sizes) != len(kv):
            raise ValueError(f"group sizes {sizes} do not cover {len(kv)} layers")
        self._launches, self.layer_event = [], []
        if extra:
            self._launches.append(Launch([v for t in extra for v in LAYOUTS["slots"](t, bs)], dev, 0))
        start = 0
        for g, size in enumerate(sizes):
            layers = kv[start : start + size]
            self._launches.append(Launch([v for t in layers for v in LAYOUTS[self.layout](t, bs)], dev, g + 1))
            self.layer_event += [g + 1] * size
            start += size
        self.num_slots = int(kv[0].shape[0] * bs if kv else extra[0].shape[0])
        if self.num_slots >= 2**31:
            raise ValueError("slots past 2**31 do not fit the int32 index buffer")
        self.token_bytes = sum(launch.token_bytes for launch in self._launches)
        self._index = torch.empty(2 * self.num_slots, dtype=torch.int32, device=dev)
        if self.cuda:
            kw = {"external": True} if graph_safe_events() else {}
            self.events = [torch.cuda.Event(**kw) for _ in range(len(sizes) + 1)]
            self._host = [torch.empty(2 * self.num_slots, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self._host_done = [torch.cuda.Event() for _ in self._host]
            self._host_used = [False, False]
            self._turn = 0
        else:
            self.events, self._host = [], [self._index]
        self._grow_stage(max(64, self._stage_tokens))
        self._layer_of = {t.data_ptr(): i for i, t in enumerate(kv)}
        self._bound = (kv, extra, self._key(kv, extra))
        self.hooked = set()

    @staticmethod
    def _key(kv, extra) -> tuple:
        return tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in [*kv, *extra])

    def _ensure_bound(self, kv: Sequence[torch.Tensor], extra: Sequence[torch.Tensor]) -> None:
        if self._bound:
            bkv, bextra, key = self._bound
            same = len(kv) == len(bkv) and len(extra) == len(bextra)
            if same and all(a is b for a, b in zip([*kv, *extra], [*bkv, *bextra])):
                return  # the same tensor objects: the serving path, every step
            if self._key(kv, extra) == key:
                return
        self.bind(kv, extra)

    def _grow_stage(self, tokens: int) -> None:
        """Staging for ``tokens`` staged moves of the largest group; allocated on the side stream, its only user."""
        self._stage_tokens = tokens
        nbytes = max(8, tokens * max(launch.stage_words * launch.word for launch in self._launches))
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self._stage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            self._stage = torch.empty(nbytes, dtype=torch.uint8)
        self._stage_views = {w: self._stage[: nbytes - nbytes % w].view(WORDS[w]) for w in WORDS}

    # ------------------------------------------------------------------ one step
    def apply(self, kv_caches: Sequence[torch.Tensor], batch: MoveBatch, extra: Sequence[torch.Tensor] = ()) -> None:
        """Move the KV of ``batch.src`` to ``batch.dst`` in every layer, and in each per-slot ``extra``."""
        if len(batch) == 0:
            return
        self._ensure_bound(kv_caches, extra)
        src, dst, n_staged = self._order(batch)
        n = src.size
        if n == 0:
            return
        host = self._next_host()
        host_np = host.numpy()
        host_np[:n], host_np[n : 2 * n] = src, dst
        if not self.cuda:
            self._launch_all(n, n_staged)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._index[: 2 * n].copy_(host[: 2 * n], non_blocking=True)
                self._host_done[self._turn].record(self.stream)
                self._launch_all(n, n_staged)
        self.bytes_moved += n * self.token_bytes
        self.staged += n_staged

    def _order(self, batch: MoveBatch) -> tuple[np.ndarray, np.ndarray, int]:
        """(sources, destinations, staged count): direct moves first, then those whose destination is read."""
        src, dst = np.asarray(batch.src, np.int64), np.asarray(batch.dst, np.int64)
        lo, hi = min(src.min(), dst.min()), max(src.max(), dst.max())
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(f"slots must lie in [0, {self.num_slots}); got [{lo}, {hi}]")
        keep = src != dst
        if not keep.all():
            src, dst = src[keep], dst[keep]
        staged = self._hazards(src, dst)
        n_staged = int(staged.sum())
        if n_staged:
            order = np.argsort(staged, kind="stable")
            src, dst = src[order], dst[order]
        return src, dst, n_staged

    @staticmethod
    def _hazards(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """bool [n]: the moves whose destination some move reads (written only after every read)."""
        return np.isin(dst, src)

    def _next_host(self) -> torch.Tensor:
        """The host index buffer for this step: the device buffer itself on CPU; on CUDA one of two pinned
        buffers, taken once the copy out of it two steps ago finished (it has, unless the GPU is two steps behind)."""
        if not self.cuda:
            return self._host[0]
        self._turn ^= 1
        if self._host_used[self._turn] and not self._host_done[self._turn].query():
            self.host_waits += 1
            self._host_done[self._turn].synchronize()
        self._host_used[self._turn] = True
        return self._host[self._turn]

    def _launch_all(self, n: int, n_staged: int) -> None:
        if n_staged > self._stage_tokens:
            self._grow_stage(max(n_staged, 2 * self._stage_tokens))
        n_direct, src, dst = n - n_staged, self._index, self._index[n:]
        for launch in self._launches:
            for phase in (0, 1) if n_staged else (0,):
                move_kernel.launch(
                    self.device.type,
                    launch.words,
                    launch.pools,
                    src,
                    dst,
                    self._stage_views[launch.word],
                    n_direct,
                    n_staged,
                    self.block_size,
                    launch.stage_words,
                    launch.num_pools,
                    phase,
                    (min(launch.geometry[0], self._MAX_TOK), *launch.geometry[1:]),
                )
                self.launches += 1
            if self.cuda:
                self.events[launch.event].record(self.stream)

    # ------------------------------------------------------------------ waits (no CPU synchronisation)
    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` (default: the current one) waits for all of the last step's moves."""
        for e in self.events:
            self._stream(stream).wait_event(e)

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` waits for the moves of layer ``layer``'s group (its KV) only."""
        if self.events:
            self._stream(stream).wait_event(self.events[self.layer_event[layer]])

    def wait_extras(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` waits for the per-slot tensors' moves (the first launch of a step)."""
        if self.events:
            self._stream(stream).wait_event(self.events[0])

    def wait_unhooked(self, stream: torch.cuda.Stream | None = None) -> None:
        """What the forward's stream waits for before the forward: the per-slot tensors, and every group one of
        whose layers has no attention hook of its own (all of them when none is installed)."""
        for g in self.unhooked_events() if self.events else ():
            self._stream(stream).wait_event(self.events[g])

    def unhooked_events(self) -> list[int]:
        """The events ``wait_unhooked`` waits on: 0 (per-slot tensors) and the groups of unhooked layers."""
        return sorted({0} | {g for i, g in enumerate(self.layer_event) if i not in self.hooked})

    def layer_of(self, kv_cache: torch.Tensor) -> int | None:
        """The bound layer whose cache starts where ``kv_cache`` does (vLLM binds each layer a view of it)."""
        return self._layer_of.get(kv_cache.data_ptr()) if self._bound else None

    def wait_host(self) -> None:
        """Block the CPU until the last moves finished (tests and benchmarks only)."""
        for e in self.events:
            e.synchronize()

    def _stream(self, stream):
        return stream if stream is not None else torch.cuda.current_stream(self.device)
