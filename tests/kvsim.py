"""A small in-test engine: block pool, per-request TokenTables, KV tensors in vLLM's CPU layout.

It drives the core exactly as the vLLM adapter does (kill -> plan -> one MoveBatch per step -> mover ->
apply_moves -> free blocks), and keeps every token's original K and V so tests can check that live tokens'
bytes survive any number of moves. Freed blocks go to the FRONT of the free list, so the next request to
grow reuses them in the same step: the hazard the gather-then-scatter mover exists for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from vtoken.mover import LAYOUTS, CpuMover, MoveBatch
from vtoken.planner import plan_compaction, to_global_slots
from vtoken.token_table import TokenTable


@dataclass
class SimRequest:
    table: TokenTable
    blocks: list[int] = field(default_factory=list)
    kv: list[torch.Tensor] = field(default_factory=list)  # per appended chunk: [n, layers, 2, heads, hs]
    num_protected: int = 0


class KVSim:
    def __init__(
        self,
        num_blocks=64,
        block_size=4,
        layers=2,
        heads=2,
        head_size=8,
        layout="cpu",
        planner=plan_compaction,
        mover=None,
        seed=0,
    ):
        self.bs, self.layers, self.heads, self.hs, self.layout = block_size, layers, heads, head_size, layout
        shape = (
            (num_blocks, heads, block_size * 2 * head_size)
            if layout == "cpu"
            else (num_blocks, heads, block_size, 2 * head_size)
        )
        self.kv = [torch.zeros(shape) for _ in range(layers)]
        self.free = deque(range(num_blocks))
        self.reqs: dict[int, SimRequest] = {}
        self.planner = planner
        self.mover = mover or CpuMover(block_size, layout)
        self.gen = torch.Generator().manual_seed(seed)
        self.moves_done = 0

    def _views(self, layer: int) -> list[torch.Tensor]:
        return LAYOUTS[self.layout](self.kv[layer], self.bs)  # K view, V view (cpu) or one K|V view

    def _write(self, slots: np.ndarray, data: torch.Tensor) -> None:
        blk, off = torch.as_tensor(slots // self.bs), torch.as_tensor(slots % self.bs)
        for layer in range(self.layers):
            views = self._views(layer)
            if len(views) == 2:
                views[0][blk, off] = data[:, layer, 0]
                views[1][blk, off] = data[:, layer, 1]
            else:
                views[0][blk, off] = torch.cat([data[:, layer, 0], data[:, layer, 1]], dim=-1)

    def read(self, slots: np.ndarray) -> torch.Tensor:
        blk, off = torch.as_tensor(slots // self.bs), torch.as_tensor(slots % self.bs)
        out = []
        for layer in range(self.layers):
            views = self._views(layer)
            if len(views) == 2:
                out.append(torch.stack([views[0][blk, off], views[1][blk, off]], dim=1))
            else:
                out.append(torch.stack(views[0][blk, off].split(self.hs, dim=-1), dim=1))
        return torch.stack(out, dim=1)

    def add(self, rid: int, num_protected: int = 0) -> None:
        self.reqs[rid] = SimRequest(TokenTable(self.bs), num_protected=num_protected)

    def append(self, rid: int, n: int) -> bool:
        r = self.reqs[rid]
        need = -(-(r.table.physical_len + n) // self.bs) - len(r.blocks)
        if need > len(self.free):
            return False
        r.blocks += [self.free.popleft() for _ in range(need)]
        local = r.table.append(n)
        data = torch.randn(n, self.layers, 2, self.heads, self.hs, generator=self.gen)
        r.kv.append(data)
        self._write(to_global_slots(local, r.blocks, self.bs), data)
        return True

    def kill(self, rid: int, logical: np.ndarray) -> None:
        self.reqs[rid].table.kill(logical)

    def compact(self) -> list:
        """One engine step's compaction for every request, applied as a single MoveBatch."""
        plans, batches = [], []
        for r in self.reqs.values():
            plan = self.planner(r.table.physical_live_mask(), r.blocks, self.bs, r.num_protected)
            plans.append((r, plan))
            batches.append(
                MoveBatch(to_global_slots(plan.src, r.blocks, self.bs), to_global_slots(plan.dst, r.blocks, self.bs))
            )
        batch = MoveBatch.concat(batches)
        self.mover.apply(self.kv, batch)
        for r, plan in plans:
            r.table.apply_moves(plan.src, plan.dst, plan.physical_len)
            r.blocks = r.blocks[: plan.keep_blocks]
            self.free.extendleft(reversed(plan.free_block_ids))  # LIFO: reused first
        self.moves_done += len(batch)
        return plans

    def finish(self, rid: int) -> None:
        self.free.extend(self.reqs.pop(rid).blocks)

    def original(self, rid: int) -> torch.Tensor:
        return torch.cat(self.reqs[rid].kv) if self.reqs[rid].kv else torch.empty(0)

    def check(self) -> None:
        """Every live token's K and V are byte-identical to what was written at its append."""
        owned = [b for r in self.reqs.values() for b in r.blocks]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self.free), "an owned block is in the free list"
        for rid, r in self.reqs.items():
            r.table.check_integrity()
            live = r.table.live_logical()
            if live.size == 0:
                continue
            got = self.read(to_global_slots(r.table.slot_of[live], r.blocks, self.bs))
            assert torch.equal(got, self.original(rid)[live]), f"request {rid}: live KV bytes changed"
