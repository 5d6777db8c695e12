"""`vtoken demo`: the main job. Serves a batch of real prompts on SmolLM2 through vLLM and shows what
vToken holds against Naive-Evict for the same eviction decisions.

Until the vLLM adapter lands, generation runs on stock vLLM and the eviction decisions are replayed
through the core (TokenTable + policy + planner) with each request's real prompt and output lengths;
the table says so. Attention-driven policies (h2o, scissorhands) need the adapter.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about memory and forgetting.",
    "List five uses of a paperclip.",
    "Summarise the plot of Romeo and Juliet in a paragraph.",
    "How does a hash table work? Keep it brief.",
    "Give three tips for writing clear code.",
    "What is the difference between weather and climate?",
]


def add_cli(sub) -> None:
    p = sub.add_parser("demo", help="generate with SmolLM2 and print what vToken held against Naive-Evict")
    p.add_argument("--model", default="smollm2-135m", help="a prepared model name (vtoken models list)")
    p.add_argument("--policy", default="random", help="eviction policy (random, streaming; h2o and "
                   "scissorhands need the vLLM adapter)")
    p.add_argument("--budget", type=float, default=0.25, help="tokens kept: a ratio < 1 or a count")
    p.add_argument("--block-size", type=int, default=32, help="KV block size (vLLM on CPU: a multiple of 32)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def generate(model_dir: str, prompts: list[str], max_tokens: int, block_size: int):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", block_size=block_size, max_model_len=2048,
              enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def run(args) -> int:
    from vtoken.models import ModelPrepareError, model_path
    from vtoken.policies import make_policy
    from vtoken.replay import replay

    try:
        policy = make_policy(args.policy, budget=args.budget)
        if policy.needs:
            raise ValueError(f"policy {args.policy!r} needs attention scores from the engine; the demo "
                             "replays decisions without them: use random or streaming")
        model_dir = model_path(args.model)
    except (ValueError, ModelPrepareError) as e:
        print(f"vtoken demo: {e}", file=sys.stderr)
        return 2
    prompts = PROMPTS[: args.num_prompts]
    t0 = time.perf_counter()
    outputs = generate(str(model_dir), prompts, args.max_tokens, args.block_size)
    gen_s = time.perf_counter() - t0
    rows = []
    for i, out in enumerate(outputs):
        n_out = len(out.outputs[0].token_ids)
        r = replay(policy, len(out.prompt_token_ids), n_out, args.block_size, request_id=str(i))
        rows.append({"prompt": prompts[i], "output": out.outputs[0].text, "prompt_tokens": len(out.prompt_token_ids),
                     "output_tokens": n_out, **r._asdict()})
    report = {"model": args.model, "policy": args.policy, "budget": args.budget, "block_size": args.block_size,
              "mode": "stock vLLM generation + core replay of the eviction decisions",
              "generation_seconds": round(gen_s, 2), "requests": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model {args.model}, policy {args.policy}, budget {args.budget}, block size {args.block_size}; "
          f"{report['mode']}; generated in {gen_s:.1f} s\n")
    hdr = f"{'req':>3} {'prompt':>6} {'output':>6} {'live':>5} {'naive blk':>9} {'vtoken blk':>10} {'floor':>5} {'moves':>6}"
    print(hdr)
    for i, r in enumerate(rows):
        print(f"{i:>3} {r['prompt_tokens']:>6} {r['output_tokens']:>6} {r['live']:>5} {r['naive_retained']:>9} "
              f"{r['retained']:>10} {r['floor']:>5} {r['moves']:>6}")
    naive = sum(r["mean_naive_retained"] for r in rows)
    vt = sum(r["mean_retained"] for r in rows)
    print(f"\ntime-averaged blocks held: naive {naive:.1f}, vtoken {vt:.1f} "
          f"({100 * (1 - vt / naive):.1f}% fewer)" if naive else "")
    for i, r in enumerate(rows[:3]):
        print(f"\n[{i}] {r['prompt']}\n    -> {r['output'].strip()[:300]}")
    return 0
