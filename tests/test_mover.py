"""The mover on real tensors in vLLM's layouts, against a per-move reference, with negative controls."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.mover import CpuMover, ReferenceMover
from vtoken.kv.mover_factory import make_mover

BS, NB, H, HS, LAYERS = 4, 12, 2, 8, 3


def caches(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (NB, H, BS * 2 * HS) if layout == "cpu" else (NB, H, BS, 2 * HS)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


@st.composite
def batches(draw):
    """Arbitrary batches with distinct destinations; sources may overlap destinations (cycles, chains)."""
    n = draw(st.integers(0, NB * BS // 2))
    slots = draw(st.permutations(range(NB * BS)))
    dst = np.array(slots[:n], dtype=np.int64)
    src = np.array(draw(st.lists(st.sampled_from(range(NB * BS)), min_size=n, max_size=n)), dtype=np.int64)
    return MoveBatch(src, dst)


@pytest.mark.parametrize("layout", ["cpu", "flash"])
@given(batch=batches())
def test_batched_mover_equals_reference(layout, batch):
    a, b = caches(layout), caches(layout)
    extra_a, extra_b = [torch.arange(NB * BS, dtype=torch.float32)], [torch.arange(NB * BS, dtype=torch.float32)]
    CpuMover(BS, layout).apply(a, batch, extra_a)
    ReferenceMover(BS, layout).apply(b, batch, extra_b)
    assert all(torch.equal(x, y) for x, y in zip(a + extra_a, b + extra_b))
    if len(batch):
        assert torch.equal(extra_a[0][torch.as_tensor(batch.dst)], torch.as_tensor(batch.src, dtype=torch.float32))


def _sequential_apply(kv, batch, layout):
    """Planted bug: scatter move by move, so a move can read a slot an earlier one overwrote."""
    for s, d in zip(batch.src, batch.dst):
        CpuMover(BS, layout).apply(kv, MoveBatch(np.array([s]), np.array([d])))


def test_negative_control_sequential_mover_corrupts_a_swap():
    swap = MoveBatch(np.array([0, 5]), np.array([5, 0]))  # block reuse within a step can chain like this
    a, b = caches("cpu"), caches("cpu")
    CpuMover(BS).apply(a, swap)
    _sequential_apply(b, swap, "cpu")
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


def test_negative_control_wrong_layout_corrupts_k():
    """Treating the CPU cache (K transposed) as a plain one moves the wrong bytes."""
    batch = MoveBatch(np.array([1, 6]), np.array([9, 13]))
    a, b = caches("cpu"), caches("cpu")
    CpuMover(BS, "cpu").apply(a, batch)
    CpuMover(BS, "flash").apply([t.view(NB, H, BS, 2 * HS) for t in b], batch)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


def test_cpu_layout_token_addressing():
    """Token t of block b, head h: K[:, t] of the transposed K block, then V[t, :]."""
    kv = torch.zeros(2, H, BS * 2 * HS)
    k = torch.arange(HS, dtype=torch.float32) + 1
    v = -k
    blk, off, head = 1, 2, 1
    kv[blk, head, : HS * BS].view(HS, BS)[:, off] = k
    kv[blk, head, HS * BS :].view(BS, HS)[off] = v
    batch = MoveBatch(np.array([blk * BS + off]), np.array([0 * BS + 3]))
    out = [kv.clone()]
    CpuMover(BS).apply(out, batch)
    assert torch.equal(out[0][0, head, : HS * BS].view(HS, BS)[:, 3], k)
    assert torch.equal(out[0][0, head, HS * BS :].view(BS, HS)[3], v)


def test_movebatch_validation():
    with pytest.raises(ValueError):
        MoveBatch(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="same destination"):
        MoveBatch(np.array([1, 2]), np.array([3, 3])).check()
    with pytest.raises(ValueError, match="unknown KV layout"):
        CpuMover(BS, "nope").apply(caches("cpu"), MoveBatch(np.array([1]), np.array([2])))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_cuda_mover_matches_cpu_mover(layout):
    rng = np.random.default_rng(0)
    dst = rng.permutation(NB * BS)[:20]
    batch = MoveBatch(rng.integers(0, NB * BS, 20), dst)
    a = caches(layout)
    b = [t.cuda() for t in a]
    CpuMover(BS, layout).apply(a, batch)
    mover = make_mover("cuda", BS, layout)
    event = mover.apply(b, batch)
    mover.wait()
    assert event is not None
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))


@pytest.mark.gpu
def test_cuda_mover_orders_after_forward_and_before_next():
    """A kernel writing KV on the compute stream, then moves on the side stream, then a read that waits."""
    kv = [torch.zeros(NB, H, BS, 2 * HS, device="cuda")]
    mover = make_mover("cuda", BS, "flash")
    for step in range(50):
        torch.cuda._sleep(200_000)  # a long "forward" ...
        kv[0][0, :, 0].fill_(step)  # ... that writes slot 0 last
        mover.apply(kv, MoveBatch(np.array([0]), np.array([NB * BS - 1 - step % 3])))
        mover.wait()
        assert kv[0][-1, :, BS - 1 - step % 3].max().item() == step
