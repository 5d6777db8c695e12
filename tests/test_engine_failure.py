"""One request's failure stays its own, inside vLLM (tiny random Llama): a policy that raises while it decides for
one request (testing.Knobs.fail_request) ends that request with finish reason "error"; the others run on, their
outputs exact against the masked reference and equal to a run without the failing request's fault; every block is
free afterwards, and the engine serves the next requests. Before, the exception left vLLM's scheduler and stopped
the EngineCore for every request (tests/test_failure_isolation.py holds the compactor's side, with a negative
control)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_engine import EVICT, check_exact, engine  # noqa: E402
from vllm_harness import Run, prompts  # noqa: E402

from vtoken.models import model_path  # noqa: E402

CFG = {"mode": "vtoken", "policy": "h2o", **EVICT, "evict": "always"}


def run_with_a_failing_request(cfg: dict, fail: str = "1", n: int = 3, max_tokens: int = 48, **engine_args):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import VTokenConfig, testing, vtoken_stats

    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    args = {"dtype": "float32", "block_size": 32, "max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20, "seed": 0,
            "skip_tokenizer_init": True, "enforce_eager": True, **engine_args}  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)
    knobs = testing.Knobs(fail_request=fail)
    with testing.open_llm(str(model_path("tiny-llama")), VTokenConfig(**cfg, trace_path=str(trace)), knobs,
                          **args) as llm:  # fmt: skip
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(n)], sp, use_tqdm=False)
        stats = vtoken_stats(llm)
        again = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(2, seed=5)], sp, use_tqdm=False)
        after = vtoken_stats(llm)
    lines = {t["request_id"]: t for t in map(json.loads, trace.read_text().splitlines())}
    return outs, stats, again, after, lines


def test_a_request_whose_policy_raises_ends_alone_and_the_others_stay_exact():
    outs, stats, again, after, lines = run_with_a_failing_request(CFG)
    reasons = {o.request_id: o.outputs[0].finish_reason for o in outs}
    assert reasons == {"0": "length", "1": "error", "2": "length"}, reasons
    assert "1" not in lines, "no trace line for a request that ended with an error"
    ok = [o for o in outs if o.request_id != "1"]
    r = Run(
        [list(o.outputs[0].token_ids) for o in ok],
        [np.array([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in ok],
        trace=[lines[o.request_id] for o in ok],
    )
    assert all(t["evicted_positions"] for t in r.trace), "the others evicted: decisions ran on after the failure"
    check_exact(r)
    plain = engine(CFG)  # the same prompts on an engine without the fault
    assert r.tokens == [plain.tokens[0], plain.tokens[2]]
    assert stats["free_blocks"] == stats["total_blocks"], "every block back in the pool"
    assert [o.outputs[0].finish_reason for o in again] == ["length", "length"], "the engine serves on"
    assert after["free_blocks"] == after["total_blocks"]


def test_a_request_whose_policy_raises_in_a_shed_ends_alone():
    """Pressure mode on a short pool: the failing request raises when the pool asks it to shed."""
    cfg = {"mode": "vtoken", "policy": "h2o", "budget": 64, "sink": 2, "recent": 8, "prefill_chunk": 32,
           "evict": "pressure", "park_tokens": 4096}  # fmt: skip
    outs, stats, again, after, _ = run_with_a_failing_request(
        cfg, n=8, max_tokens=150, kv_cache_memory_bytes=24 * 65536, max_model_len=512
    )
    reasons = {o.request_id: o.outputs[0].finish_reason for o in outs}
    assert reasons.pop("1") == "error" and set(reasons.values()) == {"length"}, reasons
    assert stats["free_blocks"] == stats["total_blocks"]
    assert all(o.outputs[0].finish_reason == "length" for o in again)


def test_a_seeded_request_whose_prompt_is_read_in_chunks_samples_as_if_read_whole():
    """Found by the engine fuzz (tests/test_fuzz_doors.py): a seeded request whose prompt took more than one forward
    stopped the engine for every request ("CPU Generator does not use offset": vLLM rewinds a discarded sample's
    generator by its CUDA offset). The runner restores a CPU generator's state instead: the request samples the same
    tokens as when its prompt is read in one forward. Failed before the fix (RuntimeError, engine dead)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import VTokenConfig, open_llm

    args = {"dtype": "float32", "block_size": 32, "max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20,
            "seed": 0, "skip_tokenizer_init": True, "enforce_eager": True, "max_num_batched_tokens": 512}  # fmt: skip
    sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True, detokenize=False) for s in (1, 2)]
    got = {}
    for name, extra in {"chunked": {"prefill_chunk": 32}, "whole": {}}.items():
        cfg = VTokenConfig(mode="vtoken", evict="pressure", **extra)
        with open_llm(str(model_path("tiny-llama")), cfg, **args) as llm:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(2, lengths=(130, 70))], sp,
                                use_tqdm=False)  # fmt: skip
            got[name] = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == 24 for t in got["chunked"])
    assert got["chunked"] == got["whole"]
