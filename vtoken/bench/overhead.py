"""Per-step overhead of vToken against stock vLLM on SmolLM2, measured side by side in one run.

Modes: off (stock), vtoken with `streaming` (compaction only, no attention scoring), vtoken and naive with
`h2o` (compaction + attention scoring). Every request generates the same number of tokens (ignore_eos),
so the ratio of wall times is the ratio of step times.
"""

from __future__ import annotations

from vtoken.bench.engine_run import log, real_prompts, run_mode


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.25)


def run(args) -> dict:
    from vtoken.models import model_path

    model = "tiny-llama" if args.quick else args.model
    n, plen, m = (2, 128, 16) if args.quick else (args.prompts, args.prompt_tokens, args.max_tokens)
    model_dir = str(model_path(model))
    prompts = real_prompts(model_dir, n, plen)
    modes = {"off": {"mode": "off"},
             "vtoken-streaming": {"mode": "vtoken", "policy": "streaming", "budget": args.budget},
             "vtoken-h2o": {"mode": "vtoken", "policy": "h2o", "budget": args.budget},
             "naive-h2o": {"mode": "naive", "policy": "h2o", "budget": args.budget}}
    runs = {label: run_mode(model_dir, label, cfg, prompts, m) for label, cfg in modes.items()}
    base = runs["off"].seconds
    rows = []
    for label, r in runs.items():
        comp = r.engine.get("compaction_seconds", 0.0)
        move = r.engine.get("move_seconds", 0.0)
        rows.append({"mode": label, "seconds": r.seconds, "ms_per_step": 1000 * r.seconds / m,
                     "ratio_to_off": r.seconds / base, "compaction_share": comp / r.seconds,
                     "move_share": move / r.seconds, "tokens_moved": r.engine.get("tokens_moved", 0),
                     "bytes_moved": r.engine.get("bytes_moved", 0)})
    for row in rows:
        log(f"{row['mode']:>17}: {row['ms_per_step']:.1f} ms/step, x{row['ratio_to_off']:.3f} of off, "
            f"scheduler compaction {100 * row['compaction_share']:.2f}%, KV moves {100 * row['move_share']:.2f}%")
    return {"model": model, "prompts": n, "prompt_tokens": plen, "max_tokens": m, "rows": rows,
            "runs": {k: vars(v) for k, v in runs.items()}}
