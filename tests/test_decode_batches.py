"""Decisions in block-sized batches and scores on demand, inside vLLM on the tiny random Llama: the default policy
(snapkv) decides about once per block of decoding from the window of its recent queries, and the per-step scorer
never runs for its decode steps (counted on the worker); h2o still scores every decode step (its definition). Both
stay exact against the masked reference rebuilt from the trace, and every forward stays within the bound, which
counts the block a request may grow by between two decisions."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_prefill_evict import bound  # noqa: E402
from test_vllm_engine import check_exact, engine  # noqa: E402

CFG = {"mode": "vtoken", "budget": 0.25, "sink": 2, "recent": 4, "prefill_chunk": 32}
LONG = dict(n=2, lengths=(90, 60), max_tokens=160)


def decisions(t: dict) -> list[int]:
    """The decode forwards at which tokens died (a decision's evictions all die at one forward)."""
    first_decode = len(t["prefill_chunks"]) + 1  # forward after the boundary that follows the last chunk
    return sorted({f for f in t["evicted_at_forward"] if f > first_decode})


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_decisions_come_once_per_block_and_stay_exact(policy):
    r = engine({**CFG, "policy": policy}, **LONG)
    for t in r.trace:
        steps = len(t["output_token_ids"]) - 1
        made = decisions(t)
        # The excess over what it keeps grows by 3/4 of a token per step at 25%: a decision per block of it.
        assert 0 < len(made) <= math.ceil(steps * 0.75 / 32) + 1, made
        held, limit = t["blocks_per_forward"], bound(t, {**CFG, "interval": 32})
        assert all(h <= m for h, m in zip(held, limit)), list(zip(held, limit))
    assert all(x["peak_over_bound"] <= 0 for x in r.stats["finished_requests"])
    check_exact(r)


def test_the_per_step_scorer_runs_for_h2o_but_never_for_snapkv_while_decoding():
    snap = engine({**CFG, "policy": "snapkv"}, **LONG)
    h2o = engine({**CFG, "policy": "h2o"}, **LONG)
    assert snap.scorer["decode_rows"] == 0 and snap.scorer["windows"] >= sum(len(decisions(t)) for t in snap.trace)
    assert snap.scorer["rows"] > 0  # the prompt's chunk windows are still scored (once per chunk)
    assert h2o.scorer["decode_rows"] >= 2 * 150 and h2o.scorer["windows"] == 0


def test_interval_one_decides_at_every_decode_step_as_before():
    r = engine({**CFG, "policy": "snapkv", "interval": 1}, **LONG)
    batched = engine({**CFG, "policy": "snapkv"}, **LONG)
    for a, b in zip(r.trace, batched.trace):
        assert len(decisions(a)) > 4 * len(decisions(b))
    check_exact(r)
    assert np.mean([len(t["evicted_positions"]) for t in r.trace]) > 0
