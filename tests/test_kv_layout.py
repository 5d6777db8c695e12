"""Learned KV layouts (vtoken/kv/kv_layout.py): the view layouts are recognised, a layout no view describes becomes a
TableLayout whose moves keep every byte, and writes that are not a permutation are refused. No vLLM: the VNNI
writer below stands in for vLLM's AMX kernel (tests/test_vllm_cpu_layout.py checks it against the real one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kv_layout_sim import vnni_layout, vnni_write

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.kv_layout import LAYOUTS, learn, resolve, table_of
from vtoken.kv.mover import CpuMover, ReferenceMover

BS, HS, NB, H, LAYERS = 32, 32, 6, 2, 2


def view_write(name: str):
    def write(kv, key, value, slots):
        views = LAYOUTS[name](kv, kv.shape[2])
        b, o = slots // kv.shape[2], slots % kv.shape[2]
        parts = (key, value) if len(views) == 2 else (torch.cat([key, value], -1),)
        for view, x in zip(views, parts):
            view[b, o] = x

    return write


def vnni():
    return vnni_layout(BS, HS)


@pytest.mark.parametrize("name", ["cpu", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_view_layout_is_recognised_and_keeps_its_fast_path(name, dtype):
    index = learn(view_write(name), BS, HS, dtype)
    assert np.array_equal(index, table_of(LAYOUTS[name], BS, HS))
    assert resolve(index, LAYOUTS) == name


def test_vnni_is_a_table_whose_positions_read_what_was_written():
    layout = vnni()
    assert sorted(layout.index.flatten().tolist()) == list(range(2 * BS * HS))  # a permutation of the chunk
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(NB * BS, generator=g)[:50]
    key, value = torch.randn(50, H, HS, generator=g), torch.randn(50, H, HS, generator=g)
    kv = torch.zeros(NB, H, BS, 2 * HS)
    vnni_write(kv, key, value, slots)
    tokens = layout.tokens(kv)[slots // BS, slots % BS]
    assert torch.equal(tokens[..., :HS], key) and torch.equal(tokens[..., HS:], value)
    k_t = kv.view(-1)[torch.as_tensor(layout.k_transposed())]  # block 0, head 0: K^T [HS, BS]
    assert torch.equal(k_t, layout.tokens(kv)[0, :, 0, :HS].T)
    # the bug this layout fixes: reading it as the vec kernel's layout gets other bytes
    assert not torch.equal(LAYOUTS["cpu"](kv, BS)[0][slots // BS, slots % BS], key)


@st.composite
def batches(draw):
    n = draw(st.integers(0, NB * BS // 2))
    dst = np.array(draw(st.permutations(range(NB * BS)))[:n], dtype=np.int64)
    src = np.array(draw(st.lists(st.sampled_from(range(NB * BS)), min_size=n, max_size=n)), dtype=np.int64)
    return MoveBatch(src, dst)


@given(batch=batches())
def test_table_mover_equals_the_per_move_reference(batch):
    layout = vnni()
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(NB, H, BS, 2 * HS, generator=g).bfloat16() for _ in range(LAYERS)]
    b = [t.clone() for t in a]
    before = [layout.tokens(t) for t in a]
    extra_a, extra_b = [torch.arange(NB * BS, dtype=torch.float32)], [torch.arange(NB * BS, dtype=torch.float32)]
    CpuMover(BS, layout).apply(a, batch, extra_a)
    ReferenceMover(BS, layout).apply(b, batch, extra_b)
    assert all(torch.equal(x, y) for x, y in zip(a + extra_a, b + extra_b))
    if len(batch):  # every destination holds its source's K and V
        s, d = torch.as_tensor(batch.src), torch.as_tensor(batch.dst)
        for old, new in zip(before, a):
            assert torch.equal(layout.tokens(new)[d // BS, d % BS], old[s // BS, s % BS])


def test_negative_control_moving_a_vnni_cache_as_the_vec_layout_corrupts_it():
    layout = vnni()
    batch = MoveBatch(np.array([1, 40, 77]), np.array([100, 130, 3]))
    a = [torch.randn(NB, H, BS, 2 * HS, generator=torch.Generator().manual_seed(2))]
    b = [a[0].clone()]
    CpuMover(BS, layout).apply(a, batch)
    CpuMover(BS, "cpu").apply(b, batch)
    assert not torch.equal(a[0], b[0])


def _drops_v(kv, key, value, slots):
    view_write("cpu")(kv, key, torch.zeros_like(value), slots)


def _swaps_heads(kv, key, value, slots):
    view_write("cpu")(kv, key.flip(1), value.flip(1), slots)


def _one_block(kv, key, value, slots):
    view_write("cpu")(kv, key, value, slots % kv.shape[2])


@pytest.mark.parametrize("write", [_drops_v, _swaps_heads, _one_block])
def test_a_write_that_is_no_per_chunk_permutation_is_refused(write):
    with pytest.raises(ValueError, match="cannot move its tokens"):
        learn(write, BS, HS, torch.bfloat16)


def test_shapes_the_probe_cannot_code_exactly_are_refused():
    with pytest.raises(ValueError, match="cannot probe"):
        learn(view_write("cpu"), 256, HS, torch.bfloat16)
