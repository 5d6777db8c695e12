"""Overhead of vToken against stock vLLM on SmolLM2, side by side in one run.

Modes (same prompts, every request generates the same number of tokens):
  stock            vllm.LLM as users start it, no vToken import in the engine
  off              make_llm(mode="off"): must equal stock (no regression)
  vtoken-noevict   vToken's scheduler and worker in the path, budget above any context: bookkeeping only
  vtoken-streaming eviction + compaction + KV moves, no attention scoring
  vtoken-h2o       the same plus attention scoring (the h2o policy)
  naive-h2o        Naive-Evict with the same decisions
Step time is vLLM's own per-request decode time, (last token - first token) / (tokens - 1). The scoring
share is h2o's step time over streaming's, both with the same budget, so the same live-token count.
Also: the mover's bandwidth against a plain copy of the same bytes, and TokenTable bytes per token
(from ``vtoken bench core``'s functions).
"""

from __future__ import annotations

import numpy as np

from vtoken.bench.engine_run import Engine, log, real_prompts
from vtoken.bench.report import Table


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.25)


def step_seconds(first_ts: float, last_ts: float, tokens: int) -> float:
    """vLLM's per-request decode step time: first to last token over the steps between them."""
    return (last_ts - first_ts) / max(tokens - 1, 1)


def _modes(budget: float) -> dict[str, tuple[str, dict | None]]:
    return {
        "stock": ("stock", None),
        "off": ("off", None),
        "vtoken-noevict": ("vtoken", {"policy": "streaming", "budget": 10**9}),
        "vtoken-streaming": ("vtoken", {"policy": "streaming", "budget": budget}),
        "vtoken-h2o": ("vtoken", {"policy": "h2o", "budget": budget}),
        "naive-h2o": ("naive", {"policy": "h2o", "budget": budget}),
    }


def _stock_batch(model_dir: str, prompts, m: int, kw: dict):
    """Stock vLLM without make_llm, timed like the others."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    log("[stock] starting vLLM ...")
    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=kw["kv_bytes"],
        max_model_len=kw["max_model_len"],
        disable_log_stats=False,
    )
    try:
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
            use_tqdm=False,
        )
        seconds = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
    steps = [step_seconds(o.metrics.first_token_ts, o.metrics.last_token_ts, len(o.outputs[0].token_ids)) for o in outs]
    return seconds, float(np.mean(steps)), {}


def run(args) -> dict:
    from vtoken.bench import core
    from vtoken.models import model_path

    model = "tiny-llama" if args.quick else args.model
    n, plen, m = (2, 128, 16) if args.quick else (args.prompts, args.prompt_tokens, args.max_tokens)
    model_dir = str(model_path(model))
    prompts = real_prompts(model_dir, n, plen)
    kw = dict(kv_bytes=1 << 30, max_model_len=plen + m + 32)
    rows = []
    for label, (mode, cfg) in _modes(args.budget).items():
        if mode == "stock":
            seconds, step, engine = _stock_batch(model_dir, prompts, m, kw)
        else:
            with Engine(model_dir, mode, cfg, **kw) as e:
                b = e.batch(prompts, m)
            seconds, engine = b.seconds, b.engine
            step = float(
                np.mean([step_seconds(s.first_token_ts, s.last_token_ts, len(s.output_tokens)) for s in b.served])
            )
        rows.append(
            {
                "mode": label,
                "seconds": seconds,
                "ms_per_step": 1000 * step,
                "compaction_seconds": engine.get("compaction_seconds", 0.0),
                "move_seconds": engine.get("move_seconds", 0.0),
                "tokens_moved": engine.get("tokens_moved", 0),
                "bytes_moved": engine.get("bytes_moved", 0),
            }
        )
        log(f"[{label}] {seconds:.1f} s, {1000 * step:.1f} ms per decode step")
    by = {r["mode"]: r for r in rows}
    for r in rows:
        r["ratio_to_stock"] = r["ms_per_step"] / by["stock"]["ms_per_step"]
        r["compaction_share"] = r["compaction_seconds"] / r["seconds"]
        r["move_share"] = r["move_seconds"] / r["seconds"]
    scoring_share = 1 - by["vtoken-streaming"]["ms_per_step"] / by["vtoken-h2o"]["ms_per_step"]
    args_core = type("A", (), {"quick": args.quick, "tokens": 16384, "moves": 4096, "repeats": 10, "device": "cpu"})
    micro = core.run(args_core)
    return {
        "model": model,
        "prompts": n,
        "prompt_tokens": plen,
        "max_tokens": m,
        "budget": args.budget,
        "rows": rows,
        "scoring_share": scoring_share,
        "core": micro,
    }


def tables(result: dict) -> list[Table]:
    rows = [
        [
            r["mode"],
            round(r["ms_per_step"], 1),
            f"x{r['ratio_to_stock']:.3f}",
            f"{100 * r['compaction_share']:.2f}%",
            f"{100 * r['move_share']:.2f}%",
            r["tokens_moved"],
        ]
        for r in result["rows"]
    ]
    c = result["core"]
    micro = [
        ["TokenTable bytes per token", f"{c['table']['bytes_per_token']:.2f} (paper: ~16)"],
        ["planner moves / lower bound", f"{c['planner']['moves']} / {c['planner']['lower_bound']}"],
        ["mover GB/s (vLLM CPU layout)", f"{c['mover']['gbps']:.2f}"],
        ["plain copy_ GB/s, same bytes", f"{c['mover']['copy_gbps']:.2f}"],
    ]
    return [
        Table(
            f"Decode step time against stock vLLM ({result['model']}, {result['prompts']} x "
            f"{result['prompt_tokens']}-token prompts, {result['max_tokens']} output tokens, budget "
            f"{result['budget']})",
            ["mode", "ms/step", "vs stock", "scheduler compaction", "KV moves", "tokens moved"],
            rows,
            f"Attention scoring (h2o against streaming at the same budget): "
            f"{100 * result['scoring_share']:.1f}% of h2o's step time.",
        ),
        Table("Core figures", ["figure", "value"], micro),
    ]


def plot(result: dict, fig) -> None:
    ax = fig.subplots(1, 1)
    rows = result["rows"]
    ax.bar([r["mode"] for r in rows], [r["ms_per_step"] for r in rows], color="tab:blue")
    ax.set(ylabel="ms per decode step", title=f"vToken overhead on {result['model']}")
    ax.tick_params(axis="x", rotation=20)
