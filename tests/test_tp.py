"""vToken with tensor parallelism (issue 6) on the tiny random Llama (4 query heads, 2 KV heads): at TP=2
each rank holds one KV head of every block, the scheduler decides once and every rank moves its own slice.

CPU: vLLM's CPU backend runs TP=2 with one OpenMP thread bound per rank. Engine starts are the cost here:
the TP=1 runs are test_prefill_evict's own (prompts read in chunks, eviction between chunks and while
decoding; cached for the session, so shared when both modules run), and one TP=2 vtoken engine serves the
mixed-policy comparison, then (switched over RPC) the one-rank-scores
negative control, then the injected rank failure that must stop it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_prefill_evict import EVICT, OPTIONS, chunked  # noqa: E402 - shared TP=1 runs (eviction between chunks)
from test_vllm_engine import POLICIES, engine  # noqa: E402

from vtoken.models import model_path  # noqa: E402
from vtoken.vllm_adapter import VTokenConfig, engine_kwargs  # noqa: E402

KV_BYTES = 64 << 20  # test_vllm_engine's pool at TP=1; per rank, so halved at TP=2: both hold 1024 blocks


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@dataclass
class Round:
    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    trace: list[dict]


@dataclass
class Session:
    rounds: dict[str, Round] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    tp_stats: list[dict] = field(default_factory=list)
    failure: BaseException | None = None
    failure_seconds: float = 0.0
    log: str = ""


@contextlib.contextmanager
def _tp_env(tp: int, log_path: Path):
    """One OpenMP thread bound per rank; the engine's stdout and stderr (its processes
    inherit fds 1 and 2 at start) copied to ``log_path``, so a test can read the engine's own error."""
    env = {
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "120",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in _cpus()[:tp]),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved_fds = [os.dup(1), os.dup(2)]
    with open(log_path, "wb") as log:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
    try:
        yield
    finally:
        for fd, saved_fd in zip((1, 2), saved_fds):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _generate(llm, requests: list[tuple[list[int], str | None]], max_tokens: int, trace_path: Path) -> Round:
    """``requests``: (prompt token ids, per-request options as JSON or None). LLM numbers requests 0, 1, ...
    per engine, as in test_vllm_engine's TP=1 runs: the random policy seeds from that number."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import request_args

    sps = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            logprobs=0,
            ignore_eos=True,
            detokenize=False,
            extra_args=request_args(**json.loads(o)) if o else None,
        )
        for _, o in requests
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests], sps, use_tqdm=False)
    lines = [json.loads(line) for line in trace_path.read_text().splitlines()] if trace_path.exists() else []
    by_id = {t["request_id"]: t for t in lines}  # the LLM's own request ids
    return Round(
        [list(o.outputs[0].token_ids) for o in outs],
        [np.array([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs],
        [by_id[o.request_id] for o in outs if o.request_id in by_id],
    )


@functools.cache
def session(mode: str, tp: int = 2, controls: bool = False, kv_cache_dtype: str = "auto") -> Session:
    """One TP engine serving test_vllm_engine's TP=1 requests (prompts, per-request policies, order). With
    ``controls``, then h2o with rank 0's scores only, then a rank that fails to apply a plan. ``kv_cache_dtype``:
    vLLM's (fp8: every rank's cache slice is fp8, moved as bytes)."""
    import torch
    from vllm import LLM

    from vtoken.vllm_adapter import shutdown_llm, testing, vtoken_stats

    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on CUDA needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    if tp > len(_cpus()):
        pytest.skip(f"TP={tp} needs {tp} CPUs, this machine allows {len(_cpus())}")
    one = engine(None) if mode == "off" else chunked()
    max_tokens = len(one.tokens[0])
    if mode == "off":  # stock vLLM has no trace; its prompts are test_vllm_engine's, in order
        from vllm_harness import prompts

        requests = [(p, None) for p in prompts(3, lengths=(70, 130, 45, 100))]
    else:
        requests = [(t["prompt_token_ids"], o) for t, o in zip(one.trace, OPTIONS)]
    tmp = Path(tempfile.mkdtemp(prefix=f"vtoken-tp{tp}-"))
    trace = tmp / "trace.jsonl"
    cfg = {"mode": "off"} if mode == "off" else {"mode": mode, "policy": "h2o", **EVICT, "trace_path": str(trace)}
    s = Session()
    with _tp_env(tp, tmp / "engine.log"):
        make_kwargs = engine_kwargs
        if controls:  # the testing worker carries the faults (vtoken/vllm_adapter/testing.py)
            make_kwargs = functools.partial(testing.engine_kwargs, knobs=testing.Knobs())
        llm = LLM(
            model=str(model_path("tiny-llama")),
            **make_kwargs(
                VTokenConfig(**{"evict": "always", **cfg}),
                dtype="float32",
                block_size=32,
                max_model_len=1024,
                seed=0,
                kv_cache_memory_bytes=KV_BYTES // tp,
                kv_cache_dtype=kv_cache_dtype,
                skip_tokenizer_init=True,
                enforce_eager=True,
                tensor_parallel_size=tp,
                distributed_executor_backend="mp",
                # as the TP=1 runs it is compared with (test_vllm_engine._run): prompts repeated across policies would
                # read each other's blocks, and tokens in shared blocks are never evicted
                enable_prefix_caching=False,
            ),
        )
        try:
            s.rounds["main"] = _generate(llm, requests, max_tokens, trace)
            if mode != "off":
                s.stats = vtoken_stats(llm)
                s.tp_stats = llm.collective_rpc("vtoken_tp_stats")
            if controls:
                h2o = [(p, o) for p, o in requests if o is None]
                llm.collective_rpc("vtoken_set_fault", args=("scores_rank0_only",))
                s.rounds["rank0_scores"] = _generate(llm, h2o, max_tokens, trace)
                llm.collective_rpc("vtoken_set_fault", args=("fail_rank1_moves",))
                t0 = time.perf_counter()
                try:
                    _generate(llm, h2o, max_tokens, trace)
                except Exception as e:  # noqa: BLE001 - the test asserts what it was
                    s.failure = e
                s.failure_seconds = time.perf_counter() - t0
        finally:
            shutdown_llm(llm)
            del llm
    s.log = (tmp / "engine.log").read_text(errors="replace")
    shutil.rmtree(tmp, ignore_errors=True)  # its log and trace are read; /tmp is shared with other runs
    return s


def evicted(r) -> list[list[int]]:
    return [t["evicted_positions"] for t in r.trace]


# ------------------------------------------------------------------ configuration edge
@pytest.mark.parametrize(
    "key,value",
    [
        ("decode_context_parallel_size", 2),
        ("prefill_context_parallel_size", 2),
        ("distributed_executor_backend", "external_launcher"),
    ],
)
def test_token_splitting_parallelism_is_refused(key, value):
    with pytest.raises(ValueError, match=key):
        engine_kwargs(VTokenConfig(mode="vtoken"), tensor_parallel_size=2, **{key: value})


# ------------------------------------------------------------------ TP=2 equals TP=1
def part(r, policy: str) -> Round:
    """The three requests of a mixed run (TP=1's or TP=2's) that ran ``policy``."""
    i = POLICIES.index(policy) * 3
    return Round(r.tokens[i : i + 3], r.logprobs[i : i + 3], r.trace[i : i + 3])


def assert_same_tokens(one, two, tol: float = 1e-4) -> None:
    """Greedy tokens equal; log-probabilities differ only by TP's summation order."""
    assert two.tokens == one.tokens
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one.logprobs, two.logprobs))
    assert worst < tol, f"log-probabilities differ by {worst:.2e}"


@pytest.mark.timeout(900)
def test_off_at_tp2_equals_tp1():
    assert_same_tokens(engine(None), session("off").rounds["main"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("policy", POLICIES)
def test_vtoken_at_tp2_makes_tp1s_decisions_and_tokens(policy):
    one, two = part(chunked(), policy), part(session("vtoken", controls=True).rounds["main"], policy)
    assert all(len(e) > 20 for e in evicted(one)), "the comparison needs real evictions"
    ids = lambda r: [t["request_id"] for t in r.trace]  # noqa: E731 - seeds of random
    assert ids(two) == ids(one)
    assert evicted(two) == evicted(one)
    assert [t["evicted_at_forward"] for t in two.trace] == [t["evicted_at_forward"] for t in one.trace]
    assert [t["prefill_chunks"] for t in two.trace] == [t["prefill_chunks"] for t in one.trace]
    assert_same_tokens(one, two)


@pytest.mark.timeout(900)
def test_retained_blocks_match_tp1():
    one, two = chunked().stats, session("vtoken", controls=True).stats
    keys = (
        "logical_tokens",
        "live_tokens",
        "retained_blocks",
        "naive_retained_blocks",
        "tokens_moved",
        "mean_retained_blocks",
        "peak_retained_blocks",
    )

    def rows(st):
        return sorted((r["request_id"], *(r[k] for k in keys)) for r in st["finished_requests"])

    assert len(rows(two)) == 9 and rows(two) == rows(one)
    assert two["total_blocks"] == one["total_blocks"] and two["free_blocks"] == two["total_blocks"]


@pytest.mark.timeout(900)
def test_naive_at_tp2_equals_vtoken():
    vt, nv = session("vtoken", controls=True), session("naive")
    assert evicted(nv.rounds["main"]) == evicted(vt.rounds["main"])
    assert nv.rounds["main"].tokens == vt.rounds["main"].tokens
    for a, b in zip(vt.rounds["main"].logprobs, nv.rounds["main"].logprobs):
        assert np.array_equal(a, b)
    rid = lambda r: r["request_id"]  # noqa: E731
    naive = {rid(r): r["mean_retained_blocks"] for r in nv.stats["finished_requests"]}
    assert len(naive) == 9
    assert all(naive[rid(r)] > r["mean_retained_blocks"] for r in vt.stats["finished_requests"])


# ------------------------------------------------------------------ the exchange
@pytest.mark.timeout(900)
def test_scores_from_one_rank_change_h2os_decisions():
    """Negative control: without the all-reduce, rank 0 decides from its own heads only."""
    control = session("vtoken", controls=True).rounds["rank0_scores"]
    assert len(control.trace) == 3
    assert evicted(control) != evicted(part(chunked(), "h2o"))


@pytest.mark.timeout(900)
def test_exchange_cost_is_counted_on_every_rank():
    ranks = session("vtoken", controls=True).tp_stats
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    for r in ranks:
        assert r["score_steps"] >= len(chunked().tokens[0]) - 1 and r["score_bytes_per_step"] > 0
        assert r["check_steps"] > 0
    assert ranks[0]["score_bytes"] == ranks[1]["score_bytes"]


@pytest.mark.timeout(900)
def test_vtoken_at_tp2_on_an_fp8_cache_is_exact():
    """Each rank moves the fp8 bytes of its own KV head; the tokens match the reference that reads the cache as
    stored (tests/test_fp8_kv.py check_fp8), and not the one that does not quantise (the negative control)."""
    import torch
    from test_fp8_kv import FP8_CPU, check_fp8

    if not torch.cuda.is_available() and not FP8_CPU:
        pytest.skip("vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
    two = session("vtoken", kv_cache_dtype="fp8").rounds["main"]
    assert len(two.trace) == 9 and all(len(e) > 20 for e in evicted(two)), "the check needs real evictions"
    check_fp8(two, "fp8")
    with pytest.raises(AssertionError):
        check_fp8(two, None)


# ------------------------------------------------------------------ fault behaviour
@pytest.mark.timeout(900)
def test_a_rank_that_fails_to_apply_a_plan_stops_the_engine():
    from vllm.v1.engine.exceptions import EngineDeadError

    s = session("vtoken", controls=True)
    assert s.failure is not None, "the engine kept serving after rank 1 failed to apply a plan"
    # A multiprocess engine core (servers) dies: EngineDeadError. In-process (conftest's default for tests)
    # the worker's error reaches the caller itself.
    assert isinstance(s.failure, EngineDeadError) or "failed to apply the compaction plan" in str(s.failure), repr(
        s.failure
    )
    assert s.failure_seconds < 100, f"the failure took {s.failure_seconds:.0f} s to surface (a hang?)"
    assert "rank(s) [1] failed to apply the compaction plan of step" in s.log, s.log[-3000:]
    assert "injected fault" in s.log and "rather than serving divergent KV" in s.log


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_on_two_gpus_the_scores_travel_over_nccl():
    """With two GPUs every test above runs on CUDA; this one checks the exchange really used NCCL."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    ranks = session("vtoken", controls=True).tp_stats
    assert all(r["backend"].startswith("nccl") for r in ranks), ranks
    assert all(r["score_steps"] > 0 for r in ranks)
