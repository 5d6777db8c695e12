"""Eviction between prefill chunks on the tiny random Llama: exact against the masked reference (rebuilt from
the trace's prefill_chunks and evicted_at_forward), negative controls, the peak bound at every forward, prefix
caching and preemption between chunks. Each engine run is cached for the session."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_engine import POLICIES, check_exact, engine  # noqa: E402

CHUNK = 32  # tokens per prefill forward: a block
EVICT = {"budget": 0.4, "sink": 2, "recent": 4, "prefill_chunk": CHUNK}
LENGTHS = (100, 130, 160)  # 4, 5 and 5 chunks
OPTIONS = tuple(None if p == "h2o" else json.dumps({"policy": p}) for p in POLICIES for _ in range(3))


def chunked(mode: str = "vtoken", **cfg):
    """One engine serving h2o (its own), random and scissorhands (per request), three prompts each."""
    return engine({"mode": mode, "policy": "h2o", **EVICT, **cfg}, options=OPTIONS, lengths=LENGTHS)


def by_policy(r, policy: str):
    i = POLICIES.index(policy) * 3
    return type(r)(r.tokens[i : i + 3], r.logprobs[i : i + 3], r.stats, r.trace[i : i + 3], r.metrics)


def prefill_evictions(trace: dict) -> int:
    """Tokens evicted at a chunk boundary before the prompt was read (not after the last chunk)."""
    n = len(trace["prefill_chunks"])
    return sum(1 for f in trace["evicted_at_forward"] if f < n)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_between_chunks_is_exact(policy):
    r = by_policy(chunked(), policy)
    for t in r.trace:
        assert len(t["prefill_chunks"]) >= 3 and sum(t["prefill_chunks"]) == len(t["prompt_token_ids"])
        assert max(t["prefill_chunks"]) <= CHUNK
        assert prefill_evictions(t) > 10, "the policy should evict while the prompt is being read"
    check_exact(r)


def test_prefill_eviction_changes_the_output():
    on, off = chunked(), chunked(prefill_evict=False)
    for t in off.trace:
        assert prefill_evictions(t) == 0
    changed = [np.mean(np.array(a) != np.array(b)) for a, b in zip(on.tokens, off.tokens)]
    assert max(changed) > 0.2, f"prefill eviction should change the tiny model's output, changed {changed}"
    check_exact(off)


def test_negative_control_evicting_one_forward_late_breaks_exactness():
    with pytest.raises(AssertionError):
        check_exact(by_policy(chunked(), "random"), late=1)


def test_negative_control_skipping_moves_breaks_exactness():
    r = engine({"mode": "vtoken", "policy": "random", **EVICT}, {"fault": "skip_moves"}, lengths=LENGTHS)
    with pytest.raises(AssertionError):
        check_exact(r)


def test_naive_pairs_vtoken_between_chunks():
    vt, nv = chunked(), chunked("naive")
    assert vt.tokens == nv.tokens
    assert [t["evicted_at_forward"] for t in vt.trace] == [t["evicted_at_forward"] for t in nv.trace]
    for a, b in zip(vt.logprobs, nv.logprobs):
        assert np.array_equal(a, b)


# ------------------------------------------------------------------ the peak bound
LONG = dict(n=2, lengths=(300, 330), max_tokens=24)  # 10 and 11 chunks


def bound(t: dict, cfg: dict) -> list[int]:
    """ceil((keep + slack + new) / block_size) + 1 for every forward of the trace, keep at the length read before
    it; slack 0 for a prefill chunk (every boundary evicts), interval - 1 for a decode step (a block less one by
    default: decisions come once per block)."""
    chunks = list(t["prefill_chunks"])
    news = chunks + [1] * (len(t["output_token_ids"]) - 1)
    interval = cfg.get("interval", 32)
    out, read = [], 0
    for i, new in enumerate(news):
        target = max(1, math.ceil(cfg["budget"] * read)) if read else 1
        keep = max(target, min(read, cfg["sink"] + cfg["recent"]))
        slack = 0 if i < len(chunks) else interval - 1
        out.append(math.ceil((keep + slack + new) / 32) + 1)
        read += new
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_peak_blocks_stay_within_the_bound_at_every_forward(policy):
    cfg = {**EVICT, "budget": 0.25}
    vt = engine({"mode": "vtoken", "policy": policy, **cfg}, **LONG)
    nv = engine({"mode": "naive", "policy": policy, **cfg}, **LONG)
    for a, b in zip(vt.trace, nv.trace):
        assert len(a["prefill_chunks"]) >= 8
        held, limit = a["blocks_per_forward"], bound(a, cfg)
        assert len(held) == len(limit)
        assert all(h <= m for h, m in zip(held, limit)), list(zip(held, limit))
        assert max(b["blocks_per_forward"]) > max(held)  # the same decisions, Naive-Evict holds more
    assert all(r["peak_over_bound"] <= 0 for r in vt.stats["finished_requests"])


# ------------------------------------------------------------------ prefix caching, preemption
def test_prefix_caching_with_prefill_eviction():
    """Three requests share a 100-token prefix, two rounds: blocks shared through the prefix cache are never
    evicted from or moved, and every output is exact."""
    r = engine({"mode": "vtoken", "policy": "h2o", **EVICT}, shared_prefix=100, rounds=2, lengths=LENGTHS)
    assert r.metrics["vllm:prefix_cache_hits"] >= 3 * 64
    hit = [t for t in r.trace if t["prefix_cached_tokens"] > 0]
    assert hit, "round two should read its prefix from the cache"
    for t in hit:
        assert min(t["evicted_positions"]) >= t["prefix_cached_tokens"]
    check_exact(r)


def test_preemption_between_chunks_resumes_exactly_and_frees_every_block():
    """A pool too small for four long prompts read together: vLLM preempts requests between their chunks; each
    resumes from token 0, its output still equals the reference, and every block comes back."""
    r = engine(
        {"mode": "vtoken", "policy": "random", **EVICT, "budget": 0.9},
        n=4,
        lengths=(330, 300, 310, 320),
        max_tokens=16,
        kv_bytes=30 * 65536,
        max_model_len=512,
    )
    assert r.stats["preemptions_in_prefill"] > 0
    check_exact(r)
    assert r.stats["free_blocks"] == r.stats["total_blocks"] and r.stats["running"] == 0


def test_snapkv_between_chunks_is_exact_and_decides_unlike_h2o():
    """The pooled policy (each request chooses it) through vLLM: exact against the masked reference, with eviction
    between chunks, and its decisions differ from h2o's on the same prompts."""
    snap = engine({"mode": "vtoken", "policy": "h2o", **EVICT}, options=(json.dumps({"policy": "snapkv"}),) * 3,
                  lengths=LENGTHS)  # fmt: skip
    for t in snap.trace:
        assert prefill_evictions(t) > 10
    check_exact(snap)
    h2o = by_policy(chunked(), "h2o")
    assert [t["evicted_positions"] for t in snap.trace] != [t["evicted_positions"] for t in h2o.trace]


# ------------------------------------------------------------------ parking (vtoken/core/park.py)
@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_parked_tokens_come_back_and_the_output_stays_exact(policy):
    """What a chunk boundary drops waits in the tier; one token before the end of the prompt the window chooses
    among live and parked tokens, some parked ones come back, and the last prompt token (which samples) sees
    them. The masked reference, rebuilt from the trace (hidden from the forward that parked them to the one that
    restored them), gives the same tokens."""
    r = by_policy(chunked(park_tokens=4096), policy)
    for t in r.trace:
        n = len(t["prefill_chunks"])
        back = t.get("restored_positions", [])
        assert len(back) > 0, "some parked tokens should come back"
        assert t["prefill_chunks"][-1] == 1, "the last prompt token, which samples, is read after the choice"
        assert all(p < f <= n for p, f in zip(t["parked_at_forward"], t["restored_at_forward"]))
        assert not set(back) & set(t["evicted_positions"][:0]), "restored tokens were not evicted then"
        joint = t["joint_forward"]
        assert joint == n - 2, "the chunk before the last prompt token attended the parked tokens"
        assert set(back) <= set(t["joint_positions"]), "what came back was among what that chunk saw"
        parked_then = [p for p, f in zip(t["evicted_positions"], t["evicted_at_forward"]) if f <= joint]
        assert set(t["joint_positions"]) <= set(parked_then) | set(back)
    check_exact(r)


def test_negative_controls_a_last_chunk_that_does_not_see_the_parked_tokens():
    """The engine's last chunk attends the parked tokens: a reference that hides them from it fails. And an engine
    whose last chunk does not attend them (the trace still saying it did) fails the reference."""
    r = by_policy(chunked(park_tokens=4096), "h2o")
    with pytest.raises(AssertionError):
        check_exact(r, joint=False)
    blind = engine({"mode": "vtoken", "policy": "h2o", **EVICT, "park_tokens": 4096}, {"fault": "blind_last_chunk"},
                   lengths=LENGTHS)  # fmt: skip
    assert all(t["joint_positions"] for t in blind.trace)
    with pytest.raises(AssertionError):
        check_exact(blind)
