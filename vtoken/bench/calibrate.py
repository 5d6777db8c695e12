"""Calibrate the simulated replica on the real engine: ``vtoken bench fleet --calibrate`` (a few minutes, CPU).

Runs tiny-llama with vToken in this process, bound to one core like a replica of ``vtoken bench goodput``
(``pin_cpus``, ``num_cpus`` 0.5 gives each replica one core), for each mode (naive, vtoken) and prefill chunk
(none, as the goodput replicas; 128, as the simulated fleet):

- every engine step is timed (between two calls of the scheduler's ``schedule``, so the output processing of
  ``LLM.generate`` is in it, as a replica's loop has its own) and described by what was scheduled; the step
  model is fitted by least squares (``numpy.linalg.lstsq``) per mode;
- requests of several prompt lengths write their trace (``trace_path``): ``blocks_per_forward`` and
  ``prefill_chunks`` give the blocks held at each context length, with eviction between prefill chunks on
  (``prefill_evict``, the default) and off (per request, ``request_args``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

from cluster.sim.calibration import BlockProfile, Calibration, StepTime, full_blocks, profile_key

POLICY, BUDGET, BLOCK = "snapkv", 0.5, 32
STEP_BATCHES = [(b, n) for n in (16, 200, 575) for b in (1, 2, 4, 8, 16)]  # (requests, prompt tokens)
TRACE_PROMPTS = (40, 150, 400, 800, 1400)
TRACE_OUTPUT = 300


def _timed_steps(llm, samples: list[tuple[float, int, int, int, int]]):
    """Wraps the in-process scheduler's ``schedule`` (VLLM_ENABLE_V1_MULTIPROCESSING=0): each call appends
    (start time, decode seqs, prefill tokens, prefill seqs, live tokens of the decoding requests). A request
    scheduled one token is a decode."""
    from vtoken.vllm_adapter.engine import inproc_scheduler

    sched = inproc_scheduler(llm)
    orig = sched.schedule

    def schedule(*a, **kw):
        t = time.perf_counter()
        out = orig(*a, **kw)
        n = out.num_scheduled_tokens
        if n:
            dec = [rid for rid, x in n.items() if x == 1]
            live = sum(map(sched.vt_core.num_live, dec))
            pre = [x for x in n.values() if x > 1]
            samples.append((t, len(dec), sum(pre), len(pre), live))
        return out

    sched.schedule = schedule


def _durations(samples) -> list[tuple[float, int, int, int, int]]:
    """Step k lasts until step k+1 starts; the last of a batch has no end and is dropped."""
    return [(b[0] - a[0], *a[1:]) for a, b in zip(samples, samples[1:])]


def fit_steps(rows: list[tuple[float, int, int, int, int]]) -> tuple[StepTime, dict[str, float]]:
    """Least squares over (seconds, decode seqs, prefill tokens, prefill seqs, decode live tokens)."""
    import numpy as np

    y = np.array([r[0] for r in rows])
    x = np.array([[1.0, r[1], r[2], r[3], r[4]] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost would be noise, and would make some batches free
    pred = x @ coef
    stats = {
        "samples": len(rows),
        "rmse_s": float(np.sqrt(np.mean((pred - y) ** 2))),
        "mean_s": float(y.mean()),
        "total_error": float(pred.sum() / y.sum() - 1),
    }
    return StepTime(*(float(c) for c in coef)), stats


def profile_from_traces(lines: list[dict[str, Any]], block_size: int) -> BlockProfile:
    """Mean ratio of held to full blocks per context length, prefill and decode forwards apart."""
    acc: dict[bool, dict[int, list[float]]] = {True: defaultdict(list), False: defaultdict(list)}
    for line in lines:
        chunks = line["prefill_chunks"]
        ctx = 0
        for i, held in enumerate(line["blocks_per_forward"]):
            prefill = i < len(chunks)
            ctx += chunks[i] if prefill else 1
            acc[prefill][ctx].append(held / full_blocks(ctx, block_size))
    out = []
    for prefill in (True, False):
        xs = sorted(acc[prefill])
        # Thin the decode points to one per 8 tokens of context: the JSON stays small, the curve the same.
        xs = xs if prefill else [x for i, x in enumerate(xs) if i % 8 == 0 or x == xs[-1]]
        out += [tuple(xs), tuple(round(sum(acc[prefill][x]) / len(acc[prefill][x]), 4) for x in xs)]
    return BlockProfile(*out)


def run(model: str = "tiny-llama", log=print) -> Calibration:
    from vtoken.bench.engine_run import Engine, real_prompts
    from vtoken.bench.goodput import KV_BYTES, skewed_load
    from vtoken.models import model_path
    from vtoken.vllm_adapter.engine import scheduler_limits

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one core, as each goodput replica
    model_dir = str(model_path(model))
    steps: dict[str, list] = defaultdict(list)
    profiles: dict[str, BlockProfile] = {}
    limits: dict[str, int] = {}
    for mode in ("vtoken", "naive"):
        for chunk in (None, 128):
            cfg = {"policy": POLICY, "budget": BUDGET, "prefill_chunk": chunk}
            with tempfile.TemporaryDirectory() as tmp:
                cfg["trace_path"] = os.path.join(tmp, "trace.jsonl")
                with Engine(model_dir, mode, cfg, kv_bytes=1 << 28, max_model_len=2048, block_size=BLOCK) as e:
                    limits = scheduler_limits(e.llm)
                    samples: list = []
                    _timed_steps(e.llm, samples)
                    e.batch(real_prompts(model_dir, 2, 64), 8, warmup=True)  # first steps are slow on CPU
                    for b, n in STEP_BATCHES:
                        samples.clear()
                        t0 = time.perf_counter()
                        e.batch(real_prompts(model_dir, b, n, offset=b), 24)
                        steps[mode] += _durations(samples)
                        log(f"[{mode}, chunk {chunk}] {b} x {n} tokens: {time.perf_counter() - t0:.2f} s")
                    open(cfg["trace_path"], "w").close()  # only the trace batch's requests below
                    prompts = real_prompts(model_dir, len(TRACE_PROMPTS), list(TRACE_PROMPTS), offset=7)
                    for evict in (True, False):
                        e.batch(prompts, TRACE_OUTPUT, options=[{"prefill_evict": evict}] * len(prompts))
                lines = [json.loads(x) for x in open(cfg["trace_path"])]
            n = len(TRACE_PROMPTS)
            for evict, part in ((True, lines[:n]), (False, lines[n:])):
                profiles[profile_key(mode, evict, chunk)] = profile_from_traces(part, BLOCK)
    fits = {m: fit_steps(rows) for m, rows in steps.items()}
    for m, (st, stats) in fits.items():
        log(f"step model {m}: {st} {stats}")
    return Calibration(
        block_size=BLOCK,
        max_num_batched_tokens=limits["max_num_batched_tokens"],
        max_num_seqs=limits["max_num_seqs"],
        step_time={m: f[0] for m, f in fits.items()},
        profiles=profiles,
        goodput=_goodput_shape(model_dir, skewed_load, KV_BYTES),
        meta={
            "model": model,
            "policy": POLICY,
            "budget": BUDGET,
            "step_fit": {m: f[1] for m, f in fits.items()},
            "threads": "one core (VLLM_CPU_OMP_THREADS_BIND)",
        },
    )


def _goodput_shape(model_dir: str, skewed_load, kv_bytes: int) -> dict[str, int]:
    """The goodput load in tokens (the gateway tokenises the prompt as it comes) and its replicas' pool."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    (heavy, heavy_out), (light, light_out) = skewed_load(2)
    block_bytes = 2 * 2 * 2 * 64 * 4 * BLOCK  # tiny-llama: 2 layers x K,V x 2 heads x 64 x fp32, per token
    return {
        "heavy_prompt": len(tok(heavy)["input_ids"]),
        "heavy_output": heavy_out,
        "light_prompt": len(tok(light)["input_ids"]),
        "light_output": light_out,
        "pool_blocks": math.floor(kv_bytes / block_bytes) - 1,  # vLLM keeps one null block
    }


def serving(cal: Calibration, goodput_json: dict[str, Any]) -> Calibration:
    """Adds the serving path's cost per streamed token from a ``vtoken bench goodput`` run: its heavy request
    alone (``heavy_alone_s``, through the gateway, a replica actor and AsyncLLM) against the same request
    in the offline step model, spread over its decode steps. One number; the same run's waves of concurrent
    requests are left to check it (``study.validate``)."""
    from dataclasses import replace

    from cluster.sim.study import alone_s

    g = cal.goodput
    offline = alone_s(cal, "vtoken", None, g["heavy_prompt"], g["heavy_output"])
    per_stream = max(0.0, (goodput_json["heavy_alone_s"] - offline) / (g["heavy_output"] - 1))
    meta = {
        **cal.meta,
        "serving": {
            "per_stream_s": per_stream,
            "heavy_alone_measured_s": goodput_json["heavy_alone_s"],
            "heavy_alone_offline_s": offline,
            "from": goodput_json.get("command"),
        },
    }
    steps = {m: replace(st, per_stream=per_stream) for m, st in cal.step_time.items()}
    return replace(cal, step_time=steps, meta=meta)
