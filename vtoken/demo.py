"""`vtoken demo`: the main job. Serves a batch of real prompts on SmolLM2 through vLLM three times - stock
(`off`), Naive-Evict (`naive`) and vToken (`vtoken`), same policy and budget - and prints, side by side,
the KV blocks each held and what each produced.
"""

from __future__ import annotations

import json
import math
import sys
import time

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Explain in three sentences why the sky is blue.",
    "Give three tips for writing clear code.",
]
MODES = ("off", "naive", "vtoken")


def add_cli(sub) -> None:
    p = sub.add_parser("demo", help="serve real prompts on SmolLM2 with off / naive / vtoken, side by side")
    p.add_argument("--model", default="smollm2-135m", help="a prepared model (vtoken models list)")
    p.add_argument("--policy", default="h2o", help="eviction policy: h2o, scissorhands, snapkv, random, streaming")
    p.add_argument("--budget", type=float, default=0.25, help="live tokens kept: ratio < 1 or a token count")
    p.add_argument("--block-size", type=int, default=32, help="KV block size (vLLM on CPU: a multiple of 32)")
    p.add_argument(
        "--evict",
        choices=("always", "pressure"),
        default="always",
        help="always: keep to the budget, to show what eviction frees; pressure (the engine's default): evict only "
        "when the pool runs short, which this demo's pool never does",
    )
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    p.add_argument("--passages", type=int, default=3, help="summarisation prompts over real text (~700 tokens)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of off,naive,vtoken")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--verbose", action="store_true", help="show vLLM's and PyTorch's logs and warnings here")
    p.set_defaults(func=run)


def build_prompts(n_passages: int) -> list[str]:
    from vtoken.texts import passages

    docs = passages(n_passages, 3000) if n_passages else []
    return QUESTIONS + [f"Summarise the following text in two sentences.\n\n{d}" for d in docs]


def serve(model_dir: str, mode: str, args, prompts: list[str]) -> dict:
    from vllm import SamplingParams

    from vtoken.vllm_adapter import VTokenConfig, open_llm, vtoken_stats

    cfg = VTokenConfig(mode=mode, policy=args.policy, budget=args.budget, evict=args.evict)
    log(f"[{mode}] starting vLLM on {args.model} ...")
    # float32: on CPUs without AVX512-BF16/AMX, vLLM's bf16 matmuls run at half the speed of fp32
    with open_llm(
        model_dir,
        cfg,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = vtoken_stats(llm) if mode != "off" else None
    finished = {r["request_id"]: r for r in (stats or {}).get("finished_requests", [])}
    rows = []
    for o in outs:
        n_prompt, n_out = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
        if mode == "off":  # stock vLLM holds every token: ceil(tokens / block_size) blocks
            full = math.ceil((n_prompt + n_out - 1) / args.block_size)
            mean = sum(math.ceil((n_prompt + k) / args.block_size) for k in range(n_out)) / max(n_out, 1)
            rec = {
                "live_tokens": n_prompt + n_out - 1,
                "retained_blocks": full,
                "mean_retained_blocks": mean,
                "peak_retained_blocks": full,
                "tokens_moved": 0,
            }
        else:
            rec = finished.get(o.request_id, {})
        rows.append({"prompt_tokens": n_prompt, "output_tokens": n_out, "text": o.outputs[0].text, **rec})
    log(f"[{mode}] {sum(r['output_tokens'] for r in rows)} tokens in {seconds:.1f} s")
    return {
        "mode": mode,
        "seconds": seconds,
        "requests": rows,
        "engine": {k: v for k, v in (stats or {}).items() if k not in ("requests", "finished_requests")},
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    from vtoken.models import ModelPrepareError, model_path
    from vtoken.vllm_adapter import VTokenConfig

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        VTokenConfig(mode="vtoken", policy=args.policy, budget=args.budget, evict=args.evict)
        if not set(modes) <= set(MODES):
            raise ValueError(f"--modes takes a subset of {','.join(MODES)}, got {args.modes!r}")
        model_dir = str(model_path(args.model))
    except (ValueError, ModelPrepareError) as e:
        print(f"vtoken demo: {e}", file=sys.stderr)
        return 2
    if getattr(args, "log_file", None):
        log(f"library logs: {args.log_file} (--verbose shows them here)")
    prompts = build_prompts(args.passages)
    results = {m: serve(model_dir, m, args, prompts) for m in modes}
    report = {
        "model": args.model,
        "policy": args.policy,
        "budget": args.budget,
        "block_size": args.block_size,
        "max_tokens": args.max_tokens,
        "prompts": prompts,
        "modes": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    modes = list(report["modes"])
    print(
        f"\nSmolLM2 ({report['model']}), policy {report['policy']}, budget {report['budget']}, "
        f"block size {report['block_size']}; blocks are time-averaged over each request's decode steps"
    )
    head = f"{'req':>3} {'prompt':>6} " + " ".join(f"{m + ' blk':>11}" for m in modes)
    print(head)
    n = len(report["prompts"])
    for i in range(n):
        cells = [f"{report['modes'][m]['requests'][i].get('mean_retained_blocks', float('nan')):>11.2f}" for m in modes]
        print(f"{i:>3} {report['modes'][modes[0]]['requests'][i]['prompt_tokens']:>6} " + " ".join(cells))
    totals = {m: sum(r.get("mean_retained_blocks", 0) for r in report["modes"][m]["requests"]) for m in modes}
    print("sum " + " " * 7 + " ".join(f"{totals[m]:>11.2f}" for m in modes))
    if "naive" in totals and "vtoken" in totals and totals["naive"]:
        print(
            f"\nvtoken holds {100 * (1 - totals['vtoken'] / totals['naive']):.1f}% fewer blocks than naive "
            f"for the same eviction decisions"
        )
    for m in modes:
        r = report["modes"][m]
        toks = sum(x["output_tokens"] for x in r["requests"])
        print(
            f"{m:>7}: {r['seconds']:.1f} s for {toks} output tokens ({1000 * r['seconds'] / max(toks, 1):.1f} ms/token"
            + (
                f"; compaction {1000 * r['engine'].get('compaction_seconds', 0):.0f} ms, "
                f"{r['engine'].get('tokens_moved', 0)} tokens moved)"
                if m != "off"
                else ")"
            )
        )
    if "naive" in modes and "vtoken" in modes:
        same = all(
            a["text"] == b["text"]
            for a, b in zip(report["modes"]["naive"]["requests"], report["modes"]["vtoken"]["requests"])
        )
        print(f"naive and vtoken outputs identical: {same}")
    for i in range(n):
        print(f"\n[{i}] {report['prompts'][i].splitlines()[0][:100]}")
        for m in modes:
            print(f"  {m:>7}: {report['modes'][m]['requests'][i]['text'].strip()[:200]!r}")
