"""vToken inside vLLM 0.32 on the tiny random Llama: identity, exactness against an independent reference,
negative controls, the Naive-Evict pair, and KV pressure. Each engine run is cached for the session."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from reference import load, masked_logprobs  # noqa: E402
from vllm_harness import prompts, run  # noqa: E402

from vtoken.models import model_path  # noqa: E402
from vtoken.vllm_adapter import VTokenConfig, engine_kwargs  # noqa: E402

EVICT = {"budget": 0.5, "sink": 2, "recent": 4}
# One engine serves the three policies: its own (h2o) for requests 0-2, per-request choices for the rest.
POLICIES = ("h2o", "random", "scissorhands")
MIXED = tuple(None if p == "h2o" else json.dumps({"policy": p}) for p in POLICIES for _ in range(3))


@functools.cache
def _run(
    cfg_json: str,
    dtype: str = "float32",
    n: int = 3,
    max_tokens: int = 48,
    kv_bytes: int = 64 << 20,
    max_model_len: int = 1024,
    shared_prefix: int = 0,
    rounds: int = 1,
    options: tuple | None = None,
    knobs: str | None = None,
    lengths: tuple = (70, 130, 45, 100),
    kv_cache_dtype: str = "auto",
):
    import tempfile

    cfg = json.loads(cfg_json)
    ps = prompts(n, lengths=lengths)
    if options:
        ps = [ps[i % n] for i in range(len(options))]
    if shared_prefix:
        ps = [ps[0][:shared_prefix] + p for p in ps]
    return run(
        str(model_path("tiny-llama")),
        cfg,
        ps,
        max_tokens=max_tokens,
        dtype=dtype,
        trace_dir=tempfile.mkdtemp(),
        kv_bytes=kv_bytes,
        max_model_len=max_model_len,
        rounds=rounds,
        enable_prefix_caching=bool(shared_prefix),
        options=[json.loads(o) if o else None for o in options] if options else None,
        knobs=json.loads(knobs) if knobs else None,
        kv_cache_dtype=kv_cache_dtype,
    )


def engine(cfg: dict | None, knobs: dict | None = None, **kw):
    return _run(json.dumps(cfg, sort_keys=True), knobs=json.dumps(knobs, sort_keys=True) if knobs else None, **kw)


def by_policy(r, policy: str):
    """The slice of a MIXED run that ran ``policy``."""
    i = POLICIES.index(policy) * 3
    return type(r)(r.tokens[i : i + 3], r.logprobs[i : i + 3], r.stats, r.trace[i : i + 3], r.metrics)


def mixed(mode: str = "vtoken"):
    return engine({"mode": mode, "policy": "h2o", **EVICT}, options=MIXED)


@functools.lru_cache(maxsize=1)
def reference_model():
    return load(str(model_path("tiny-llama")))


def check_exact(r, tol=1e-4, late: int = 0, joint: bool = True, kv_cache_dtype: str | None = None):
    """Tokens equal the masked reference's greedy tokens; log-probabilities within tol. ``late`` and ``joint``:
    negative controls of the reference (tests/reference.py). ``kv_cache_dtype``: the reference reads keys and
    values as that cache stores them."""
    ref = reference_model()
    worst = 0.0
    for tokens, lps, tr in zip(r.tokens, r.logprobs, r.trace):
        greedy, ref_lp = masked_logprobs(ref, tr, late, joint, kv_cache_dtype)
        assert tr["output_token_ids"] == tokens
        assert np.allclose(tr["logprobs"], lps), "the trace's logprobs are the ones the request received"
        assert greedy.tolist() == tokens, "greedy tokens differ from the masked reference"
        worst = max(worst, float(np.abs(ref_lp - lps).max()))
    assert worst <= tol, f"log-probabilities differ from the masked reference by {worst:.2e}"
    return worst


# ------------------------------------------------------------------ configuration edge
def test_off_is_stock_vllm():
    kw = {"dtype": "float32", "block_size": 32}
    assert engine_kwargs(VTokenConfig(mode="off"), **kw) == kw
    assert engine_kwargs(None, **kw) == kw


@pytest.mark.parametrize(
    "key,value",
    [("speculative_config", {"method": "ngram"}), ("async_scheduling", True), ("pipeline_parallel_size", 2)],
)
def test_incompatible_features_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        engine_kwargs(VTokenConfig(mode="vtoken"), **{key: value})


def test_the_default_is_snapkv_in_pressure_mode_with_the_tier():
    # docs/design.md "Why these defaults"; tests of eviction at a budget ask for evict "always"
    # (tests/vllm_harness.py), and test_pressure.py shows the default is stock vLLM while the pool holds everything.
    cfg = VTokenConfig()
    assert (cfg.mode, cfg.policy, cfg.evict, cfg.park_tokens) == ("vtoken", "snapkv", "pressure", "auto")


def test_bad_config_values():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        VTokenConfig(policy="lru")
    with pytest.raises(ValueError, match="whole"):
        VTokenConfig(budget=2.5)
    with pytest.raises(ValueError):
        VTokenConfig(mode="sometimes")


# ------------------------------------------------------------------ identity
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_relocating_every_token_is_bit_identical_to_stock(dtype):
    """No evictions, but every request's KV is moved into fresh blocks every 3 steps."""
    stock = engine(None, dtype=dtype)
    moved = engine({"mode": "vtoken", "policy": "random", "budget": 100000}, {"relocate_every": 3}, dtype=dtype)
    assert moved.stats["tokens_moved"] > 1000
    assert moved.tokens == stock.tokens
    for a, b in zip(moved.logprobs, stock.logprobs):
        assert np.array_equal(a, b)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_equal_a_masked_reference(policy):
    """Requests 3-8 choose their policy per request (SamplingParams.extra_args) on an h2o engine."""
    r = by_policy(mixed(), policy)
    assert all(len(t["evicted_positions"]) > 20 for t in r.trace)
    check_exact(r)
    changed = [np.mean(np.array(a) != np.array(b)) for a, b in zip(r.tokens, engine(None).tokens)]
    assert min(changed) > 0.2, f"eviction should visibly change the tiny model's output, changed {changed}"


def test_attention_policies_decide_differently_from_random():
    evicted = {p: [t["evicted_positions"] for t in by_policy(mixed(), p).trace] for p in POLICIES}
    assert evicted["h2o"] != evicted["random"] and evicted["scissorhands"] != evicted["random"]
    assert evicted["h2o"] != evicted["scissorhands"]


def test_request_options_are_checked():
    from vtoken.vllm_adapter import request_args

    assert request_args(policy="random", budget=0.25) == {"vtoken": {"policy": "random", "budget": 0.25}}
    with pytest.raises(ValueError, match="not per-request"):
        request_args(mode="off")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        request_args(policy="lru")
    with pytest.raises(ValueError, match="does not collect"):
        VTokenConfig(policy="random").for_request({"policy": "h2o"})


@pytest.mark.parametrize("fault", ["skip_moves", "physical_rope"])
def test_negative_controls_break_exactness(fault):
    r = engine({"mode": "vtoken", "policy": "random", **EVICT}, {"fault": fault})
    with pytest.raises(AssertionError):
        check_exact(r)


# ------------------------------------------------------------------ prefix caching
def test_prefix_caching_shares_blocks_safely():
    """Three requests share a 100-token prefix, in two rounds on one engine. vLLM shares the first two
    blocks (64 tokens): no request evicts a token there, and every output - including round two's, whose
    prefix hits land on blocks left by round one after it evicted and moved tokens - still equals the
    masked reference, so no block that lost or gained tokens was served as a prefix hit."""
    r = engine({"mode": "vtoken", "policy": "h2o", **EVICT}, shared_prefix=100, rounds=2)
    assert r.metrics["vllm:prefix_cache_hits"] >= 3 * 64
    check_exact(r)
    assert all(min(t["evicted_positions"]) >= 64 for t in r.trace)


# ------------------------------------------------------------------ Naive-Evict pair
def test_naive_and_vtoken_make_the_same_decisions_and_outputs():
    vt, nv = mixed("vtoken"), mixed("naive")
    assert vt.tokens == nv.tokens
    assert [t["evicted_positions"] for t in vt.trace] == [t["evicted_positions"] for t in nv.trace]
    for a, b in zip(vt.logprobs, nv.logprobs):
        assert np.array_equal(a, b)


def test_score_every_evicts_only_after_observed_steps_and_stays_exact():
    """h2o with score_every=4 (the opt-in cheaper scoring): decode steps 4, 8, ... are observed, so decode-time
    evictions come at those steps only; outputs still equal the masked reference, naive makes the same
    decisions, and they differ from exact h2o's."""
    cfg = {"policy": "h2o", **EVICT, "interval": 1, "policy_params": {"score_every": 4}}
    vt, nv = engine({"mode": "vtoken", **cfg}), engine({"mode": "naive", **cfg})
    steps = np.concatenate([t["evicted_at_step"] for t in vt.trace])
    decode = set(steps[steps > 1].tolist())  # 0: between prefill chunks; 1: the boundary after the last one
    assert decode and decode <= set(range(4, 49, 4)), sorted(decode)
    check_exact(vt)
    assert vt.tokens == nv.tokens
    assert [t["evicted_positions"] for t in vt.trace] == [t["evicted_positions"] for t in nv.trace]
    exact = engine({"mode": "vtoken", "policy": "h2o", **EVICT, "interval": 1})
    assert [t["evicted_positions"] for t in vt.trace] != [t["evicted_positions"] for t in exact.trace]


def test_vtoken_retains_the_floor_and_naive_never_fewer():
    vt = mixed("vtoken").stats["finished_requests"]
    nv = mixed("naive").stats["finished_requests"]
    assert len(vt) == len(nv) == 9
    order = lambda r: int(r["request_id"])  # noqa: E731 - the LLM's own ids: "0", "1", ...
    for a, b in zip(sorted(vt, key=order), sorted(nv, key=order)):
        floor = math.ceil(a["live_tokens"] / 32)
        assert floor <= a["retained_blocks"] <= floor + 1  # + the block being filled
        assert b["retained_blocks"] >= a["retained_blocks"]
        assert b["mean_retained_blocks"] > a["mean_retained_blocks"]
        assert b["retained_blocks"] >= b["naive_retained_blocks"] - 1


# ------------------------------------------------------------------ pressure
PRESSURE = dict(n=8, max_tokens=150, kv_bytes=24 * 65536, max_model_len=512)


def test_under_kv_pressure_vtoken_preempts_least_and_everything_is_freed():
    cfg = {"policy": "h2o", "budget": 64, "sink": 2, "recent": 8}
    runs = {
        "off": engine(None, **PRESSURE),
        "naive": engine({"mode": "naive", **cfg}, **PRESSURE),
        "vtoken": engine({"mode": "vtoken", **cfg}, **PRESSURE),
    }
    pre = {m: r.metrics["vllm:num_preemptions"] for m, r in runs.items()}
    assert pre["vtoken"] < pre["naive"] and pre["vtoken"] < pre["off"], pre
    for mode in ("naive", "vtoken"):
        assert runs[mode].stats["free_blocks"] == runs[mode].stats["total_blocks"]
    assert runs["off"].metrics["vllm:kv_cache_usage_perc"] == 0
    assert all(len(t) == 150 for r in runs.values() for t in r.tokens)
    # A request preempted while decoding resumes from token 0; its trace keeps every run, and each output token
    # equals the reference under the run that sampled it.
    resumed = [t for t in runs["naive"].trace if t.get("preempted_runs")]
    assert resumed and any(run["evicted_positions"] for t in resumed for run in t["preempted_runs"])
    check_exact(runs["naive"])
    check_exact(runs["vtoken"])


def test_the_block_wise_scorer_makes_the_per_slot_scorers_decisions():
    """Decode-only eviction at every decode step (as before prefill eviction and batched decisions existed): h2o's
    and scissorhands' traces equal the ones the earlier per-slot scorer produced on the same requests (tests/data,
    recorded with commit c83fb8e)."""
    golden = json.loads((Path(__file__).parent / "data" / "traces_per_slot_scorer.json").read_text())
    r = engine({"mode": "vtoken", "policy": "h2o", **EVICT, "prefill_evict": False, "interval": 1}, options=MIXED)
    for policy in ("h2o", "scissorhands"):
        for old, new in zip(golden[policy], by_policy(r, policy).trace):
            assert new["prompt_token_ids"] == old["prompt_token_ids"]
            assert new["evicted_positions"] == old["evicted_positions"]
            assert new["evicted_at_step"] == old["evicted_at_step"]
            assert new["output_token_ids"] == old["output_token_ids"]


def test_tokens_to_go_counts_unread_prompt_and_tokens_left_to_generate():
    """The pool report's work left (what weighted placement reads), on vLLM's Request fields by hand: a request
    half way through its prompt, one decoding, one done."""
    from types import SimpleNamespace as R

    from vtoken.vllm_adapter.scheduler import tokens_to_go

    reading = R(num_prompt_tokens=500, num_computed_tokens=200, max_tokens=160, num_output_tokens=0)
    decoding = R(num_prompt_tokens=500, num_computed_tokens=540, max_tokens=160, num_output_tokens=40)
    done = R(num_prompt_tokens=8, num_computed_tokens=23, max_tokens=16, num_output_tokens=16)
    assert tokens_to_go([reading]) == 300 + 160
    assert tokens_to_go([decoding]) == 120  # computed tokens past the prompt are outputs: nothing to read
    assert tokens_to_go([reading, decoding, done]) == 580 and tokens_to_go([]) == 0
