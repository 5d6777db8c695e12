"""Cost of vToken's cross-rank exchange under tensor parallelism (TP=2 by default) on the tiny Llama.

    .venv/bin/python -m vtoken.bench.tp [--tp 2] [--prompts 4 --prompt-tokens 1024 --max-tokens 64]

Per decode step, every rank all-reduces the attention weights of the step's decode slots (4 bytes per
slot: ``4 * sum(physical seq_len)`` over decoding requests) and, on steps that carry a compaction plan,
all-gathers one status int32 per rank. Both are timed inside the workers (tp.ExchangeStats) and set
against the step time of the same run. Policies: h2o (needs the exchange) and streaming (must skip it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vtoken.bench.engine_run import log
from vtoken.config import SHIPPED_BUDGET


def add_args(p) -> None:
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET)


def _run_policy(model_dir: str, policy: str, args, prompts) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import VTokenConfig, open_llm, vtoken_stats

    cfg = VTokenConfig(mode="vtoken", policy=policy, budget=args.budget, evict="always")
    with open_llm(
        model_dir,
        cfg,
        dtype="float32",
        block_size=32,
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=(256 << 20) // args.tp,
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp",
    ) as llm:
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ranks = llm.collective_rpc("vtoken_tp_stats")
        numel = max(1, round(ranks[0]["score_bytes_per_step"] / 4))
        probe = llm.collective_rpc("vtoken_tp_probe", args=(numel,))
        engine = {k: v for k, v in vtoken_stats(llm).items() if k not in ("requests", "finished_requests")}
    steps = args.max_tokens
    row = {
        "policy": policy,
        "seconds": seconds,
        "ms_per_step": 1000 * seconds / steps,
        "ranks": ranks,
        "score_bytes_per_step": ranks[0]["score_bytes_per_step"],
        "score_us_per_step": max(r["score_us_per_step"] for r in ranks),
        "check_us_per_step": max(r["check_us_per_step"] for r in ranks),
        "exchange_share": max(r["score_seconds"] + r["check_seconds"] for r in ranks) / seconds,
        "tokens_moved": engine.get("tokens_moved", 0),
        "probe": probe,
        "probe_score_us": max(r["score_us"] for r in probe),
        "probe_check_us": max(r["check_us"] for r in probe),
    }
    log(
        f"[{policy}] TP={args.tp}: {row['ms_per_step']:.1f} ms/step; score all-reduce "
        f"{row['score_bytes_per_step']:.0f} B/step in {row['score_us_per_step']:.0f} us over "
        f"{ranks[0]['score_steps']} steps; plan check {row['check_us_per_step']:.0f} us over "
        f"{ranks[0]['check_steps']} steps; {100 * row['exchange_share']:.2f}% of generation time; "
        f"ranks in step ({ranks[0]['backend']}): all-reduce of {4 * numel} B {row['probe_score_us']:.0f} us, "
        f"plan check {row['probe_check_us']:.0f} us"
    )
    return row


def run(args) -> dict:
    import numpy as np

    from vtoken.models import model_path

    n, plen = (2, 256) if args.quick else (args.prompts, args.prompt_tokens)
    if args.quick:
        args.max_tokens = 16
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, cpus[: args.tp])))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 49000, plen).tolist() for _ in range(n)]
    model_dir = str(model_path("tiny-llama"))
    rows = [_run_policy(model_dir, p, args, prompts) for p in ("h2o", "streaming")]
    return {
        "model": "tiny-llama",
        "tp": args.tp,
        "prompts": n,
        "prompt_tokens": plen,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m vtoken.bench.tp", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out", help="folder for tp.json")
    p.add_argument("--quick", action="store_true", help="small settings for a smoke test")
    add_args(p)
    args = p.parse_args()
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp.json").write_text(json.dumps({"settings": vars(args), **result}, indent=2))
    print(f"wrote {out / 'tp.json'}")


if __name__ == "__main__":  # vLLM spawns its processes: they import this module, they must not rerun it
    main()
