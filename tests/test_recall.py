"""Recall (issue 42): nothing a request gives up is lost while the tier has room, and a decoding request brings back
what its next tokens need. On the tiny random Llama: every token parked (decode decisions and sheds included)
and recalled while decoding, exact against the masked reference; a recall the reference is not told about breaks
exactness (negative control); the summary path (page boxes) against the exact one."""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from reference import runs  # noqa: E402
from test_vllm_engine import PRESSURE, check_exact, engine  # noqa: E402

SHORT = {**PRESSURE, "lengths": (70, 130, 45, 100)}
PRESSURE_CFG = {"mode": "vtoken", "policy": "snapkv", "budget": 64, "sink": 2, "recent": 8, "prefill_chunk": 32,
                "evict": "pressure", "park_tokens": 4096, "recall_every": 4}  # fmt: skip
ALWAYS_CFG = {"mode": "vtoken", "policy": "snapkv", "budget": 0.5, "sink": 2, "recent": 4, "evict": "always",
              "interval": 4, "park_tokens": 4096, "recall_every": 4}  # fmt: skip


def decode_restores(trace: dict) -> int:
    """Tokens brought back while decoding (restored at a forward after the prompt's last chunk), every run."""
    total = 0
    for run in runs(trace):
        chunks = len(run.get("prefill_chunks") or [])
        total += sum(r > chunks for r in run.get("restored_at_forward", []))
    return total


def recalls_hidden(r):
    """A copy of run ``r`` whose traces leave out every token brought back while decoding (a negative control)."""
    hidden = copy.deepcopy(r)
    for t in hidden.trace:
        chunks = len(t.get("prefill_chunks") or [])
        keep = [i for i, at in enumerate(t.get("restored_at_forward", [])) if at <= chunks]
        for key in ("restored_positions", "parked_at_forward", "restored_at_forward"):
            if key in t:
                t[key] = [t[key][i] for i in keep]
    return hidden


@pytest.mark.parametrize("name, cfg, kw", [("pressure", PRESSURE_CFG, SHORT), ("always", ALWAYS_CFG, {})])
def test_recall_while_decoding_is_exact(name, cfg, kw):
    r = engine(cfg, **kw)
    assert r.stats["recalls"] > 0 and r.stats["tokens_recalled"] > 0, r.stats
    assert sum(decode_restores(t) for t in r.trace) > 0, "tokens came back while decoding"
    check_exact(r)
    assert r.stats["free_blocks"] == r.stats["total_blocks"]


@pytest.mark.parametrize("name, cfg, kw", [("pressure", PRESSURE_CFG, SHORT), ("always", ALWAYS_CFG, {})])
def test_negative_control_a_recall_the_reference_is_not_told_about_breaks_exactness(name, cfg, kw):
    r = engine(cfg, **kw)
    with pytest.raises(AssertionError):
        check_exact(recalls_hidden(r))


def test_without_recall_parked_tokens_come_back_only_when_the_pool_has_room_and_outputs_stay_exact():
    r = engine({**PRESSURE_CFG, "recall_every": 0}, **SHORT)
    assert r.stats["recalls"] == 0 and r.stats["tokens_recalled"] == 0 and r.stats["tokens_parked"] > 0
    restored_while_decoding = sum(decode_restores(t) for t in r.trace)
    assert restored_while_decoding == r.stats["tokens_reinflated"]
    check_exact(r)


def test_a_recall_at_every_step_costs_no_preemption_and_stays_exact():
    """Issue 58: in pressure mode a request's recall is its one compaction of the step, and a request that recalled
    used to be left out of the step's shed. At recall_every 1 the requests holding parked tokens recall at every
    step, so they never gave back a block, and vLLM preempted running requests for their growth (6-7 preemptions
    here, 1 without recall: the pool then runs out at the budgets). A recall now sheds its share in the same
    choice: no more preemptions than without recall, tokens still come back, outputs equal the masked reference."""
    every = engine({**PRESSURE_CFG, "recall_every": 1}, **SHORT)
    never = engine({**PRESSURE_CFG, "recall_every": 0}, **SHORT)
    pre = {name: r.metrics["vllm:num_preemptions"] for name, r in (("every", every), ("never", never))}
    assert pre["every"] <= pre["never"], pre
    assert every.stats["recalls"] > 0 and every.stats["tokens_recalled"] > 0, every.stats
    assert sum(decode_restores(t) for t in every.trace) > 0, "tokens came back while decoding"
    check_exact(every)
    assert every.stats["free_blocks"] == every.stats["total_blocks"]


def test_recall_with_summaries_and_exact_both_stay_exact_and_mostly_agree():
    summary = engine({**PRESSURE_CFG, "recall_exact": False}, **SHORT)
    exact = engine({**PRESSURE_CFG, "recall_exact": True}, **SHORT)
    check_exact(summary)
    check_exact(exact)
    assert summary.stats["tokens_recalled"] > 0 and exact.stats["tokens_recalled"] > 0
    np.testing.assert_array_equal(len(summary.tokens), len(exact.tokens))


def test_when_the_pressure_ends_parked_tokens_come_back_and_outputs_stay_exact():
    r = engine(PRESSURE_CFG, **SHORT)
    assert r.stats["tokens_reinflated"] > 0, r.stats
    check_exact(r)


def test_the_summaries_candidates_are_audited_against_the_exact_path(monkeypatch):
    """VTOKEN_RECALL_AUDIT=1: every recall by summaries also scores every parked token exactly and counts how many
    of the exact top 32 the summaries' candidates held (the benchmarks report it on SmolLM2)."""
    monkeypatch.setenv("VTOKEN_RECALL_AUDIT", "1")
    r = engine({**PRESSURE_CFG, "recall_every": 3}, **SHORT)
    audit = r.scorer["recall_audit"]
    assert audit["recalls"] > 0 and 0 < audit["found"] <= audit["top"], audit
    assert audit["candidates"] < audit["parked"], "summaries scored fewer tokens than the exact path"
    assert r.scorer["bytes_recalled"] > 0
    print("summary recall of the exact top 32:", audit["found"] / audit["top"], audit)
