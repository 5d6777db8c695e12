"""vToken on vLLM's fp8 KV caches (issue 58), on the tiny random Llama: every mode exact against the masked reference
that reads keys and values as the cache stores them (tests/reference.py ``fp8_as_stored``), with negative controls;
and the pieces below the engine (the quantiser, the layout probe, the scorer) against the CPU kernel and plain
references. vLLM's CPU fp8 cache needs AVX-512 or AMX: without them these tests skip."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

FP8_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
pytestmark = pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")

from reference import fp8_as_stored, masked_logprobs  # noqa: E402
from test_recall import ALWAYS_CFG, PRESSURE_CFG, SHORT, decode_restores, recalls_hidden  # noqa: E402
from test_vllm_engine import EVICT, engine, reference_model  # noqa: E402
from vllm_harness import prompts  # noqa: E402

from vtoken.kv.kv_dtype import FP8, KvFormat, quantize  # noqa: E402
from vtoken.kv.kv_layout import FP8_EXACT, learn, resolve  # noqa: E402

H2O = {"mode": "vtoken", "policy": "h2o", **EVICT}
# An fp8 cache holds 4x the tokens of fp32 in the same bytes: a quarter of the bytes puts the pool under the same
# pressure as test_recall's
SHORT_FP8 = {**SHORT, "kv_bytes": SHORT["kv_bytes"] // 4}
# Exact up to fp8's own rounding. The engine and the reference compute K and V in fp32 in different orders (1e-7
# apart); where a value sits that close to a step of fp8 (cut toward zero), the two store neighbouring codes, and
# an fp8 code is 1/8 of its value (e4m3). Such flips are rare per element but a run stores millions of elements:
# measured on the pressure run below, they move a log-probability by at most 3.5e-3 and flip one near-tied greedy
# token of 1,200. What the masked reference checks moves far more: the same run against a reference that does
# not quantise is 0.14 off (299 tokens), one with its recalls hidden 1.6 (741 tokens). FLIP_TOL sits between.
FLIP_TOL = 0.02
MODES = {
    "evicting": (H2O, {}),
    "naive": ({"mode": "naive", "policy": "h2o", **EVICT}, {}),
    "pressure, parking, recall": (PRESSURE_CFG, SHORT_FP8),
    "pressure with a floor": ({**PRESSURE_CFG, "pressure_floor": 0.5}, SHORT_FP8),
    "recall every step": ({**ALWAYS_CFG, "recall_every": 1}, {}),
    "prefix hits": (H2O, {"shared_prefix": 64, "rounds": 2}),
}


def _cpu_write(kv_cache_dtype: str, isa: str, k_scale: float = 1.0, v_scale: float = 1.0):
    from vllm import _custom_ops as ops

    def write(kv, key, value, slots):  # as CPUAttentionBackendImpl.do_kv_cache_update calls it
        nb, heads, bs, _ = kv.shape
        k, v = kv.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k, v, slots, isa, k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip

    return write


# ------------------------------------------------------------------ below the engine
@pytest.mark.parametrize("name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_quantize_is_byte_for_byte_the_cpu_kernels_write(name, dtype, scale):
    """vtoken/kv/kv_dtype.py ``quantize`` (toward zero, clamped) against vLLM's CPU cache write; the reference's own
    quantiser (written from the format's definition) agrees with both; round-to-nearest (CUDA's) does not."""
    torch.manual_seed(0)
    nb, heads, bs, d = 8, 2, 32, 64
    n = nb * bs
    x = (torch.randn(n, heads, d) * torch.logspace(-6, 5, n)[:, None, None]).to(dtype)
    kv = torch.zeros(nb, heads, bs, 2 * d, dtype=torch.uint8)
    _cpu_write(name, "vec", scale, scale)(kv, x, x, torch.arange(n))
    stored = kv.view(nb, heads, -1)[..., : d * bs].reshape(nb, heads, d, bs).permute(0, 3, 1, 2).reshape(n, heads, d)
    assert torch.equal(quantize(x, FP8[name], scale), stored)
    read = stored.view(FP8[name]).float() * scale
    assert torch.equal(fp8_as_stored(x.float(), name, scale), read)
    assert not torch.equal(quantize(x, FP8[name], scale, nearest=True), stored)  # the negative control


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_the_layout_of_an_fp8_cache_is_learned_from_the_kernel(name, isa):
    """The probe codes fit fp8 (digits 1..8) and decode to the layout the kernel writes: each token's elements where
    the kernel put them, checked by writing real values and reading them back through the learned table."""
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX here")
    bs, d = 32, 64
    write = _cpu_write(name, isa)
    index = learn(write, bs, d, torch.float32, store=torch.uint8, read=lambda kv: kv.view(FP8[name]).float(),
                  exact=FP8_EXACT)  # fmt: skip
    layout = resolve(index)
    if isa == "vec":
        assert layout == "cpu"  # the vec kernel stores fp8 K^T per block, as it stores fp32
    torch.manual_seed(1)
    x = torch.randn(2 * bs, 2, d)
    kv = torch.zeros(2, 2, bs, 2 * d, dtype=torch.uint8)
    write(kv, x, -x, torch.arange(2 * bs))
    chunks = kv.view(4, -1)  # (block, kv head) chunks
    got = chunks[:, torch.as_tensor(index)].view(2, 2, bs, 2 * d).permute(0, 2, 1, 3).reshape(2 * bs, 2, 2 * d)
    assert torch.equal(got[..., :d], quantize(x, FP8[name]))
    assert torch.equal(got[..., d:], quantize(-x, FP8[name]))
    with pytest.raises(ValueError, match="not a per-"):  # codes past 8 are not exact in e5m2: the probe must fail
        learn(write, bs, d, torch.float32, store=torch.uint8, read=lambda kv: kv.view(FP8[name]).float() * 0.5,
              exact=FP8_EXACT)  # fmt: skip


def test_the_scorer_reads_fp8_keys_through_the_layers_scale():
    """The attention scorer on an fp8 cache with k_scale 0.5 gives the statistics it gives on the float cache
    holding the dequantised keys (fp8 * 0.5); ignoring the scale (a format without it) does not."""
    torch.manual_seed(2)
    bs, d, heads, nb = 32, 64, 2, 6
    x = torch.randn(nb * bs, heads, d) * 3
    raw = torch.zeros(nb, heads, bs, 2 * d, dtype=torch.uint8)
    _cpu_write("fp8", "vec", 0.5, 0.5)(raw, x, x, torch.arange(nb * bs))
    plain = raw.view(torch.float8_e4m3fn).float() * 0.5
    fmt = KvFormat.of("fp8", [raw])
    fmt = KvFormat(fmt.fp8, ((0.5, 0.5),), {raw.data_ptr(): 0})
    unscaled = KvFormat(fmt.fp8, ((1.0, 1.0),), {raw.data_ptr(): 0})
    want = observe_decode(plain, bs, KvFormat())
    assert np.allclose(observe_decode(raw, bs, fmt), want, rtol=1e-5, atol=1e-7)
    assert not np.allclose(observe_decode(raw, bs, unscaled), want, rtol=1e-3, atol=1e-5)


def observe_decode(kv: torch.Tensor, bs: int, fmt: KvFormat) -> np.ndarray:
    """One decode query (two query heads per kv head) over every slot of ``kv`` (vLLM's CPU layout), through the
    attention scorer: the slots' attention sums."""
    from types import SimpleNamespace

    from vtoken.kv.scores import AttentionScorer

    nb, heads, _, d = kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[3] // 2
    seq = nb * bs
    q = torch.randn(1, 2 * heads, d, generator=torch.Generator().manual_seed(3))
    scorer = AttentionScorer(seq, bs, "cpu", torch.device("cpu"), fmt=fmt)
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([seq]),
                         block_table=torch.arange(nb)[None], max_seq_len=seq)  # fmt: skip
    scorer.begin_step([0], [1])
    scorer.observe(q, kv, md, d**-0.5)
    scorer.end_step()
    return scorer.acc.numpy().copy()


# ------------------------------------------------------------------ the engine, exact
def _stock_exact(r, kv_cache_dtype: str, lengths=(70, 130, 45, 100)) -> float:
    """Stock vLLM (no trace): its outputs against the reference with nothing hidden."""
    traces = [{"prompt_token_ids": p, "output_token_ids": t, "evicted_positions": [], "evicted_at_forward": []}
              for p, t in zip(prompts(len(r.tokens), lengths=lengths), r.tokens)]  # fmt: skip
    return check_fp8(SimpleNamespace(tokens=r.tokens, logprobs=r.logprobs, trace=traces), kv_cache_dtype)


def check_fp8(r, kv_cache_dtype: str | None) -> float:
    """``check_exact`` for an fp8 cache: log-probabilities within FLIP_TOL of the reference that reads keys and
    values as the cache stores them, and greedy tokens equal but for at most one near tie in a hundred."""
    ref, worst, wrong, total = reference_model(), 0.0, 0, 0
    for tokens, lps, tr in zip(r.tokens, r.logprobs, r.trace):
        greedy, ref_lp = masked_logprobs(ref, tr, kv_cache_dtype=kv_cache_dtype)
        wrong += int((greedy != np.asarray(tokens)).sum())
        total += len(tokens)
        worst = max(worst, float(np.abs(ref_lp - np.asarray(lps)).max()))
    assert worst <= FLIP_TOL, f"log-probabilities differ from the masked reference by {worst:.2e}"
    assert wrong <= max(1, total // 100), f"{wrong} of {total} greedy tokens differ from the masked reference"
    return worst


@pytest.mark.vllm
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_stock_vllm_on_fp8_matches_the_quantising_reference_and_not_the_plain_one(kv):
    """The reference is right about the cache: stock vLLM's fp8 outputs match it, and not the unquantised one."""
    r = engine(None, kv_cache_dtype=kv)
    _stock_exact(r, kv)
    with pytest.raises(AssertionError):
        _stock_exact(r, "auto")


@pytest.mark.vllm
@pytest.mark.parametrize("mode", list(MODES))
def test_vtoken_on_fp8_is_exact_in_every_mode(mode):
    cfg, kw = MODES[mode]
    r = engine(cfg, kv_cache_dtype="fp8", **kw)
    moved = sum(len(t["evicted_positions"]) for t in r.trace)
    assert moved > 0, "requests evicted, shed or parked"
    if mode == "prefix hits":
        assert r.metrics["vllm:prefix_cache_hits"] > 0
    if "recall" in mode:
        assert r.stats["recalls"] > 0 and sum(decode_restores(t) for t in r.trace) > 0, r.stats
    check_fp8(r, "fp8")
    assert r.stats["free_blocks"] == r.stats["total_blocks"]
    with pytest.raises(AssertionError):  # negative control: a reference that does not quantise
        check_fp8(r, None)


@pytest.mark.vllm
def test_vtoken_on_fp8_e5m2_is_exact():
    r = engine(H2O, kv_cache_dtype="fp8_e5m2")
    check_fp8(r, "fp8_e5m2")
    with pytest.raises(AssertionError):
        check_fp8(r, "fp8")  # the other fp8 format is not what this cache stores


@pytest.mark.vllm
def test_negative_control_skipped_moves_on_fp8_break_exactness():
    r = engine({"mode": "vtoken", "policy": "random", **EVICT}, {"fault": "skip_moves"}, kv_cache_dtype="fp8")
    with pytest.raises(AssertionError):
        check_fp8(r, "fp8")


@pytest.mark.vllm
def test_a_recall_hidden_from_the_reference_breaks_fp8_exactness():
    r = engine(PRESSURE_CFG, kv_cache_dtype="fp8", **SHORT_FP8)
    assert sum(decode_restores(t) for t in r.trace) > 0
    with pytest.raises(AssertionError):
        check_fp8(recalls_hidden(r), "fp8")
