"""Everything that reads keys and values as numbers reads an fp8 cache through ``KvFormat`` (vtoken/kv/kv_dtype.py):
an fp8 cache with per-layer scales gives the scorer, parking's tier (its last chunk, its boxes and keys) and the
query window what the float cache holding the dequantised values gives them, and its bytes move unchanged. No vLLM:
the CUDA versions (marked gpu) run in scripts/gpu_check.sh; the CPU kernel itself is checked in test_fp8_kv.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.kv_dtype import FP8, KvFormat, element_format, quantize
from vtoken.kv.query_window import QueryWindow
from vtoken.kv.scores import AttentionScorer
from vtoken.kv.tier import KVTier

BS, D, KVH, HEADS, LAYERS, BLOCKS = 4, 8, 2, 4, 3, 16
SCALES = ((0.5, 2.0), (1.0, 1.0), (0.25, 0.75))  # (k_scale, v_scale) per layer
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def twins(device: str, layout: str, name: str = "fp8", scales=SCALES):
    """(fp8 caches as uint8 with their format, float32 caches of the same values dequantised, plain format)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    shape = (BLOCKS, KVH, BS * 2 * D) if layout == "cpu" else (BLOCKS, KVH, BS, 2 * D)
    fp8 = FP8[name]
    raw, plain = [], []
    for ks, vs in scales:
        x = torch.randn(shape, generator=g) * 4
        scale = torch.full(shape, ks)  # K then V, per layout: cpu is [K^T | V] per (block, head); flash [.., K | V]
        if layout == "cpu":
            scale.view(BLOCKS, KVH, 2, -1)[:, :, 1] = vs
        else:
            scale[..., D:] = vs
        q = quantize(x / scale, fp8, nearest=device == "cuda")  # as each device's kernel writes it
        raw.append(q.to(device))
        plain.append((q.view(fp8).float() * scale).to(device))
    by_ptr = {t.data_ptr(): i for i, t in enumerate(raw)}
    return raw, KvFormat(fp8, tuple(scales), by_ptr), plain, KvFormat()


def test_supported_dtypes_and_a_clear_refusal():
    assert element_format("auto") is None and element_format("bfloat16") is None
    assert element_format("fp8_e5m2") == torch.float8_e5m2 and element_format("fp8") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="int8_per_token_head"):
        element_format("int8_per_token_head")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_the_scorer_on_fp8_equals_the_scorer_on_the_dequantised_cache(device, layout):
    raw, fmt, plain, none = twins(device, layout)
    seq, blocks = 40, torch.tensor([[4, 9, 1, 12, 3, 7, 0, 2, 5, 6]], device=device)
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 3], device=device),
                         seq_lens=torch.tensor([seq], device=device), block_table=blocks, max_seq_len=seq)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    queries = [torch.randn(3, HEADS, D, generator=g).to(device) for _ in range(LAYERS)]

    def acc(caches, f):
        s = AttentionScorer(BLOCKS * BS, BS, layout, torch.device(device), fmt=f)
        s.begin_step([0], [3])
        for q, kv in zip(queries, caches):
            s.observe(q, kv, md, 0.3)
        s.end_step()
        return s.acc.cpu().numpy()

    want = acc(plain, none)
    assert np.allclose(acc(raw, fmt), want, rtol=1e-5, atol=1e-6)
    unscaled = KvFormat(fmt.fp8, ((1.0, 1.0),) * LAYERS, fmt._by_ptr)  # negative control: scales ignored
    assert not np.allclose(acc(raw, unscaled), want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_the_tier_parks_fp8_bytes_and_reads_them_through_the_layers_scales(device, layout):
    raw, fmt, plain, none = twins(device, layout)
    original = [t.clone() for t in raw]
    tiers = {"fp8": KVTier(16, raw, layout, BS, D, fmt=fmt), "plain": KVTier(16, plain, layout, BS, D, fmt=none)}
    park = MoveBatch(np.array([3, 40, 41, 60]), np.array([5, 0, 9, 2]))
    for name, caches in (("fp8", raw), ("plain", plain)):
        tiers[name].park(caches, [], park)
    assert tiers["fp8"].kv[0].dtype == torch.uint8  # the tier holds the pool's bytes
    for layer in range(LAYERS):
        slots = np.array([5, 0, 9])
        assert torch.allclose(tiers["fp8"].keys(layer, slots), tiers["plain"].keys(layer, slots))
        lo8, hi8 = tiers["fp8"].boxes(np.array([0]))
        lo, hi = tiers["plain"].boxes(np.array([0]))
        assert torch.allclose(lo8[layer], lo[layer]) and torch.allclose(hi8[layer], hi[layer])
    # the last chunk attends live and parked keys: the same output from either cache
    md = SimpleNamespace(seq_lens=torch.tensor([40]), query_start_loc=torch.tensor([0, 12]),
                         block_table=torch.tensor([[4, 9, 1, 12, 3, 7, 0, 2, 5, 6]]))  # fmt: skip
    g = torch.Generator().manual_seed(2)
    q = torch.randn(12, HEADS, D, generator=g).to(device)
    outs = {}
    for name, caches in (("fp8", raw), ("plain", plain)):
        tier = tiers[name]
        tier.begin([(0, 4, np.array([5, 0, 9]))])
        outs[name] = [torch.zeros(12, HEADS, D, device=device) for _ in caches]
        for kv, out in zip(caches, outs[name]):
            tier.observe(q, kv, md, 0.3, out)
        tier._rows = []
    for a, b in zip(outs["fp8"], outs["plain"]):
        assert torch.allclose(a, b, atol=1e-5)
    # parked bytes come back byte for byte
    for t in raw:
        t.zero_()
    back = MoveBatch(np.array([5, 0, 9, 2]), np.array([3, 40, 41, 60]))
    tiers["fp8"].restore(raw, [], back, tiers["fp8"].fetch(back))
    if device == "cuda":
        torch.cuda.synchronize()
    at = tiers["fp8"]._positions(raw[0], np.array([3, 40, 41, 60]))
    for t, o in zip(raw, original):
        assert torch.equal(t.view(-1)[at].cpu(), o.view(-1)[at].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_the_query_window_and_recall_read_fp8_keys_through_the_scales(device, layout):
    raw, fmt, plain, none = twins(device, layout)
    g = torch.Generator().manual_seed(3)
    scores = {}
    for name, caches, f in (("fp8", raw, fmt), ("plain", plain, none)):
        window = QueryWindow(2, caches, layout, BS, HEADS, D, window=3, dtype=torch.float32, fmt=f)
        tier = KVTier(16, caches, layout, BS, D, fmt=f)
        tier.park(caches, [], MoveBatch(np.array([50, 51, 52]), np.array([0, 1, 2])))
        row = window.row_of("a")
        g.manual_seed(3)
        for t in range(3):
            window.begin([(row, 0, 6 + t)])
            for kv in caches:
                window.record(torch.randn(1, HEADS, D, generator=g).to(device), kv, None, 0.3)
        live = window.score(row, [5, 2, 9], 9, caches)
        both = window.score_with_parked(row, [5, 2, 9], 9, caches, tier, np.array([0, 1, 2]))
        scores[name] = (live, *both)
    for a, b in zip(scores["fp8"], scores["plain"]):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6)
