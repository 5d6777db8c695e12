"""Eviction under pressure (``evict="pressure"``) on the tiny random Llama: on a pool that never runs short it is
stock vLLM to the bit; on a pool that does, requests give back what the pool is short and never go below their
budget (tests/test_shedding.py holds the plan itself), vLLM preempts no more than with ``evict="always"``, what a
request sheds while reading its prompt is parked and chosen again with the question, and the outputs equal the
masked reference rebuilt from the trace (a negative control applies each shed a forward late). Each engine run is
cached for the session (tests/test_vllm_engine.py ``engine``)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_engine import PRESSURE, check_exact, engine  # noqa: E402

from vtoken.core.policies import make_policy  # noqa: E402

CHUNK, BS = 32, 32
CFG = {"mode": "vtoken", "policy": "h2o", "budget": 64, "sink": 2, "recent": 8, "prefill_chunk": CHUNK}
SHORT = {**PRESSURE, "lengths": (70, 130, 45, 100)}


def short(evict: str):
    return engine({**CFG, "evict": evict, "park_tokens": 4096}, **SHORT)


def test_a_pool_that_never_runs_short_is_stock_vllm_to_the_bit():
    off = engine(None)
    on = engine({**CFG, "evict": "pressure", "prefill_chunk": None})  # stock vLLM here reads prompts whole too
    assert on.tokens == off.tokens
    assert all(np.array_equal(a, b) for a, b in zip(on.logprobs, off.logprobs))
    assert all(not t["evicted_positions"] and "shed_at_forward" not in t for t in on.trace)
    assert on.stats["tokens_evicted"] == 0


def test_a_short_pool_sheds_elastically_preempts_no_more_than_always_and_stays_exact():
    pressure, always = short("pressure"), short("always")
    shed = [t for t in pressure.trace if "shed_at_forward" in t]
    assert shed and pressure.stats["tokens_evicted"] > 0, "the pool ran short: requests should shed"
    pre = {m: r.metrics["vllm:num_preemptions"] for m, r in (("pressure", pressure), ("always", always))}
    assert pre["pressure"] <= pre["always"], pre
    policy = make_policy("h2o", budget=CFG["budget"], sink=CFG["sink"], recent=CFG["recent"])
    for t in pressure.trace:
        total = len(t["prompt_token_ids"]) + len(t["output_token_ids"])
        assert len(t["evicted_positions"]) <= total - policy.target(total), "went below its budget"
    assert sum(len(t["evicted_positions"]) for t in pressure.trace) < sum(
        len(t["evicted_positions"]) for t in always.trace
    ), "pressure mode gives back only what the pool is short: fewer tokens than keeping to the budget"
    assert pressure.stats["free_blocks"] == pressure.stats["total_blocks"]
    check_exact(pressure)


def test_negative_control_a_shed_applied_a_forward_late_breaks_exactness():
    r = short("pressure")
    late = copy.deepcopy(r)
    for t in late.trace:
        if "shed_at_forward" in t and not t.get("preempted_runs"):
            s = t["shed_at_forward"]
            t["evicted_at_forward"] = [f + 1 if f == s else f for f in t["evicted_at_forward"]]
    with pytest.raises(AssertionError):
        check_exact(late)


def test_snapkv_keepers_shed_by_their_decode_window_scored_on_demand_and_stay_exact():
    """snapkv (the default policy) scores on demand: in pressure mode a decoding request that keeps every token
    has no per-step scorer and no window while memory is plentiful (test above: stock vLLM to the bit); when the
    pool may run short its recent queries are kept and scored before the shed (Compactor.foresee), so the shed
    judges its decode tokens too, not only its prompt's. Outputs equal the masked reference."""
    r = engine({**CFG, "policy": "snapkv", "evict": "pressure", "park_tokens": 4096}, **SHORT)
    assert [t for t in r.trace if "shed_at_forward" in t], "the pool ran short: requests should shed"
    assert r.scorer["decode_rows"] == 0, "no per-step scorer for an on-demand policy"
    assert r.scorer["windows"] > 0, "the keepers' decode windows were scored before their sheds"
    decode_deaths = 0
    for t in r.trace:
        died = np.asarray(t["evicted_positions"], dtype=np.int64)
        decode_deaths += int((died >= len(t["prompt_token_ids"])).sum())
    assert decode_deaths > 0, "the window judged decode tokens too"
    check_exact(r)


def test_a_floor_holds_back_who_does_not_fit_sheds_less_and_stays_exact():
    """``pressure_floor`` (0.9): a waiting request is admitted only while every request fits at its floor
    (vtoken/core/shedding.py admissible), so fewer run at once, fewer tokens are shed, nobody is preempted, and the
    outputs equal the masked reference."""
    floored = engine({**CFG, "evict": "pressure", "park_tokens": 4096, "pressure_floor": 0.9}, **SHORT)
    plain = short("pressure")
    assert floored.stats["peak_running"] < plain.stats["peak_running"], (floored.stats, plain.stats)
    # tokens given up at sheds (parked in the tier, so not dead: recall and re-inflation may bring them back)
    shed = {m: sum(t.get("shed_tokens", 0) for t in r.trace) for m, r in (("floor", floored), ("plain", plain))}
    assert shed["floor"] < shed["plain"], shed
    assert floored.metrics["vllm:num_preemptions"] == 0
    assert floored.tokens != plain.tokens or shed["floor"] == 0
    check_exact(floored)


def test_a_request_s_own_floor_is_the_engine_s_floor_for_it():
    """``request_args(pressure_floor=0.9)`` on an engine without a floor: every request asking gives the engine
    with ``pressure_floor: 0.9`` to the token and to the shed; when half of them ask, those shed fewer tokens than
    the others, nobody is preempted, and the outputs equal the masked reference."""
    ask = json.dumps({"pressure_floor": 0.9})
    cfg = {**CFG, "evict": "pressure", "park_tokens": 4096}
    own = engine(cfg, options=(ask,) * SHORT["n"], **SHORT)
    floored = engine({**cfg, "pressure_floor": 0.9}, **SHORT)
    assert own.tokens == floored.tokens
    assert own.stats["peak_running"] == floored.stats["peak_running"]
    assert [t["evicted_positions"] for t in own.trace] == [t["evicted_positions"] for t in floored.trace]
    half = engine(cfg, options=(ask, None) * (SHORT["n"] // 2), **SHORT)
    shed = [t.get("shed_tokens", 0) for t in half.trace]
    asked, others = sum(shed[0::2]), sum(shed[1::2])
    assert others > 0 and asked < others, (asked, others)
    assert half.metrics["vllm:num_preemptions"] == 0
    check_exact(half)


def test_a_floor_asked_in_always_mode_admits_as_without_it_and_the_engine_lives():
    """A request that asks a ``pressure_floor`` but evicts ``always`` (the floor only binds in pressure mode), on an
    engine with a parking tier: the scheduler's admission limit is the tier's alone. Found by the doors' engine fuzz
    (tests/test_fuzz_doors.py): the floor's limit came back None beside the tier's number, and ``min(None, n)`` in
    vtoken/vllm_adapter/scheduler.py ``_admission_limit`` killed the EngineCore. Same tokens as without the option."""
    ask = json.dumps({"pressure_floor": 0.9})
    cfg = {**CFG, "evict": "always", "park_tokens": 4096}
    asked = engine(cfg, options=(ask,) * SHORT["n"], **SHORT)
    plain = engine(cfg, **SHORT)
    assert asked.tokens == plain.tokens
    assert [t["evicted_positions"] for t in asked.trace] == [t["evicted_positions"] for t in plain.trace]
