"""A small engine around the REAL compactor (vtoken/core/compactor.py): a block pool, KV tensors in vLLM's layouts,
and steps in the engine's order.

One ``step``: ``Compactor.plan_step`` (sync, policy evictions), explicit evictions through ``Compactor.evict``
(what a policy would choose, drawn by the test), then the forwards' block allocations (which may reuse blocks
freed a moment ago, as vLLM's scheduler does), the step's moves applied as ONE batch by the mover, and only then
the forwards' new K/V written - the order of the worker. Every token's original K and V are kept, so tests can
check that live tokens' bytes survive any number of steps. Freed blocks go to the FRONT of the free list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from vtoken.core.compactor import Compactor
from vtoken.core.move_batch import MoveBatch
from vtoken.core.park import TierSlots
from vtoken.core.planner import moves_lower_bound, to_global_slots
from vtoken.core.policies import make_policy
from vtoken.core.step import Progress
from vtoken.kv.kv_layout import LAYOUTS
from vtoken.kv.mover import CpuMover
from vtoken.kv.tier import KVTier
from vtoken.kv.worker_step import apply_kv_step

NEVER = 10**9  # a budget no request reaches: the policy evicts nothing unless the test says so


@dataclass(eq=False)
class SimBlock:
    block_id: int
    ref_cnt: int = 0


class SimPool:
    """vLLM's BlockPool interface: get_new_blocks, free_blocks, get_num_free_blocks, evict_blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [SimBlock(i) for i in range(num_blocks)]
        self.free = deque(self.blocks)
        self.uncached: set[int] = set()
        self.num_gpu_blocks = num_blocks + 1  # as vLLM's BlockPool counts: with its null block, which we lack

    def get_new_blocks(self, n: int) -> list[SimBlock]:
        if n > len(self.free):
            raise ValueError(f"pool has {len(self.free)} free blocks, {n} asked")
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            b.ref_cnt += 1
        return out

    def free_blocks(self, blocks) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free.appendleft(b)  # reused first: the hazard the gather-then-scatter mover exists for

    def get_num_free_blocks(self) -> int:
        return len(self.free)

    def evict_blocks(self, ids: set[int]) -> None:
        self.uncached |= set(ids)


@dataclass
class SimRequest:
    blocks: list = field(default_factory=list)
    kv: list[torch.Tensor] = field(default_factory=list)  # per forward: [n, layers, 2, heads, hs]
    computed: int = 0
    outputs: int = 0


class KVSim:
    def __init__(
        self,
        num_blocks=64,
        block_size=4,
        layers=2,
        heads=2,
        head_size=8,
        layout="cpu",
        mover=None,
        mode="vtoken",
        seed=0,
        trace=False,
        floor=0.0,
        tier_tokens=0,
    ):
        self.bs, self.layers, self.heads, self.hs, self.layout = block_size, layers, heads, head_size, layout
        shape = (
            (num_blocks, heads, block_size * 2 * head_size)
            if layout == "cpu"
            else (num_blocks, heads, block_size, 2 * head_size)
        )
        self.kv = [torch.zeros(shape) for _ in range(layers)]
        self.pool = SimPool(num_blocks)
        self.reqs: dict[str, SimRequest] = {}
        slots = TierSlots(tier_tokens) if tier_tokens else None
        self.core = Compactor(mode, block_size, self.pool, lambda rid: self.reqs[rid].blocks, slots, trace=trace,
                              floor=floor)  # fmt: skip
        # The tier's bytes (the worker's half, vtoken/kv/tier.py), so parked tokens come back byte for byte.
        self.kvtier = KVTier(tier_tokens, self.kv, layout, block_size, head_size) if tier_tokens else None
        self.mover = mover or CpuMover(block_size, layout)
        self.gen = torch.Generator().manual_seed(seed)
        self.moves_done = 0
        self.shared: list[SimBlock] = []  # blocks a phantom second request also holds (a cached prefix)

    # ---------------------------------------------------------------- requests
    def add(
        self,
        rid: str,
        prompt: int,
        num_protected: int = 0,
        policy=None,
        prefill_evict: bool = True,
        pressure: bool = False,
        floor: float | None = None,
    ) -> None:
        """A request whose first ``num_protected`` blocks (full) are shared with another request. ``floor``: its
        own pressure_floor (None: the simulator's)."""
        r = self.reqs[rid] = SimRequest()
        policy = policy or make_policy("random", budget=NEVER, sink=0, recent=0)
        self.core.admit(rid, rid, policy, prefill_len=prompt, prefill_evict=prefill_evict, pressure=pressure,
                        floor=floor)  # fmt: skip
        if num_protected:
            r.computed = num_protected * self.bs  # a prefix-cache hit: those tokens' KV exists already
            r.blocks += self.pool.get_new_blocks(num_protected)
            for b in r.blocks:
                b.ref_cnt += 1  # the phantom sharer
            self.shared += r.blocks

    def finish(self, rid: str) -> dict | None:
        """The request finished: its blocks go back; returns its trace line when the simulator traces."""
        line = self.core.remove(rid, finished=True)
        self.pool.free_blocks(reversed(self.reqs.pop(rid).blocks))
        return line

    def preempt(self, rid: str, policy=None, pressure: bool = False, floor: float | None = None) -> None:
        """vLLM's recompute preemption: the blocks go back, and the request is admitted again to recompute every
        token it had (prompt and outputs) before it samples again, as a new run."""
        self.core.remove(rid, finished=False)
        r = self.reqs[rid]
        self.pool.free_blocks(reversed(r.blocks))
        r.blocks, r.kv, prefill = [], [], r.computed
        r.computed = 0
        policy = policy or make_policy("random", budget=NEVER, sink=0, recent=0)
        self.core.admit(rid, rid, policy, prefill_len=prefill, outputs_at_start=r.outputs, pressure=pressure,
                        floor=floor)  # fmt: skip

    # ---------------------------------------------------------------- one engine step
    def step(
        self,
        forwards: dict[str, int],
        kills: dict[str, tuple[int, int]] | None = None,
        waiting: list[int] = (),
        watermark: int = 0,
        failures: dict[str, str] | None = None,
    ) -> MoveBatch:
        """``forwards``: request -> new tokens its forward computes this step. ``kills``: request -> (n, seed): the
        test evicts n random live tokens outside shared blocks (after the policy's own decisions), as a policy
        would. ``waiting`` and ``watermark``: pressure mode's demand beyond the running requests (the tokens of
        each waiting request's first forward, and blocks kept free). ``failures``: collects the requests whose
        decision raised, which end alone as in the engine (None: such a failure fails the test). Returns the step's
        moves."""
        plan = self.core.plan_step(
            [Progress(rid, r.computed, r.outputs, forwards.get(rid, 1)) for rid, r in self.reqs.items()],
            waiting,
            watermark,
        )
        failed = self.core.take_failed()
        if failed and failures is None:  # a bug the test must see
            raise AssertionError(f"the compactor failed for {failed}")
        for rid, why in failed.items():  # as the engine's glue: each ends alone, with an error, its blocks freed
            failures[rid] = why
            self.finish(rid)
            forwards = {k: n for k, n in forwards.items() if k != rid}
        batches = [plan.moves]
        self.evicted = {}  # request -> (moves, their lower bound, blocks kept, live tokens) of the test's evictions
        for rid, (n, seed) in (kills or {}).items():
            if rid in plan.keep_blocks:
                continue  # its policy evicted this step already: one compaction per request per step
            st = self.core.states[rid]
            live = st.table.live_logical()
            live = live[live >= len(self.protected_tokens(rid))]  # never evict tokens of shared blocks
            victims = np.sort(np.random.default_rng(seed).choice(live, min(n, live.size), replace=False))
            if victims.size:
                mask = st.table.physical_live_mask()
                mask[st.table.slot_of[victims]] = False
                bound = moves_lower_bound(mask, self.bs, len(self.protected_tokens(rid)) // self.bs)
                moves, keep = self.core.evict(st, victims)
                batches.append(moves)
                self.evicted[rid] = (len(moves), bound, keep, st.table.num_live)
        batch = MoveBatch.concat(batches)
        self.core.check_integrity(batch)
        writes = []
        for rid, n in forwards.items():
            r, table = self.reqs[rid], self.core.states[rid].table
            need = -(-(table.physical_len + n) // self.bs) - len(r.blocks)
            if need > self.pool.get_num_free_blocks():
                continue  # not scheduled this step (vLLM would wait or preempt)
            r.blocks += self.pool.get_new_blocks(max(need, 0))
            r.computed += n
            self.core.scheduled(rid, n, r.computed, r.outputs)  # as the engine: before this forward samples
            if r.computed >= self.core.states[rid].prefill_len:
                r.outputs += 1
            ids = [b.block_id for b in r.blocks]
            slots = to_global_slots(np.arange(table.physical_len, table.physical_len + n), ids, self.bs)
            writes.append((r, slots, torch.randn(n, self.layers, 2, self.heads, self.hs, generator=self.gen)))
        if self.kvtier is not None:  # as the worker: tier slots freed, then fetch, park, moves, restore
            self.kvtier.free(plan.tier_freed)
            apply_kv_step(self.mover, self.kvtier, self.kv, [], batch, plan.park, plan.restore)
        else:
            self.mover.apply(self.kv, batch)  # the worker moves first, then the forward writes
        for r, slots, data in writes:
            r.kv.append(data)
            self._write(slots, data)
        self.moves_done += len(batch)
        return batch

    # ---------------------------------------------------------------- KV bytes
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

    def check(self) -> None:
        """The compactor's invariants, and every live token's K and V byte-identical to what its forward wrote."""
        self.core.check_integrity()
        owned = [b.block_id for r in self.reqs.values() for b in r.blocks if b.ref_cnt == 1]
        owned += [b.block_id for st in self.core.states.values() for b in st.ballast]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & {b.block_id for b in self.pool.free}, "an owned block is in the free list"
        for rid, r in self.reqs.items():
            table = self.core.states[rid].table
            live = table.live_logical()
            live = live[live >= len(self.protected_tokens(rid))]
            if live.size == 0:
                continue
            got = self.read(to_global_slots(table.slot_of[live], [b.block_id for b in r.blocks], self.bs))
            want = torch.cat(r.kv)[live - len(self.protected_tokens(rid))]
            assert torch.equal(got, want), f"request {rid}: live KV bytes changed"

    def protected_tokens(self, rid: str) -> range:
        """Logical positions in the request's shared blocks (their KV was written by the phantom sharer)."""
        n = sum(1 for b in self.reqs[rid].blocks if b in self.shared) * self.bs
        return range(n)
