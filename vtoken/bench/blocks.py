"""Retained KV blocks per request, off / naive / vtoken, for every policy and budget, on real text.

One engine per mode serves every (policy, budget, prompt) combination at once: each request carries its
own policy options (SamplingParams.extra_args), so naive and vtoken make the same decisions for the same
request. Per request we read vToken's record: blocks held, time-averaged over the decode steps and at the
peak, what Naive-Evict holds (naive mode holds exactly that), and the floor ceil(live / block_size).
Stock vLLM (off) holds ceil(tokens / block_size) blocks; it serves each prompt once as the reference.
"""

from __future__ import annotations

import math

import numpy as np

from vtoken.bench.engine_run import Engine, log, real_prompts
from vtoken.bench.report import Table

POLICIES = ("h2o", "scissorhands", "random", "streaming")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--budgets", default="0.5,0.25,0.125", help="live-token ratios")
    p.add_argument("--prompt-tokens", default="1024,2048,4096,6144", help="prompt lengths (real text)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=16)


def _settings(args):
    if args.quick:
        return "tiny-llama", list(POLICIES), [0.5, 0.25], [256, 512], 32
    return (args.model, args.policies.split(","), [float(b) for b in args.budgets.split(",")],
            [int(t) for t in args.prompt_tokens.split(",")], args.max_tokens)


def off_blocks(prompt: int, out: int, bs: int) -> tuple[float, int]:
    """Stock vLLM holds every token: time-averaged (over decode steps) and peak blocks."""
    held = [math.ceil((prompt + k) / bs) for k in range(1, out)]
    return float(np.mean(held)), held[-1]


def run(args) -> dict:
    from vtoken.models import model_path

    model, policies, budgets, lengths, m = _settings(args)
    model_dir = str(model_path(model))
    prompts = real_prompts(model_dir, len(lengths), lengths)
    combos = [(p, b, i) for p in policies for b in budgets for i in range(len(prompts))]
    options = [{"policy": p, "budget": b} for p, b, _ in combos]
    kw = dict(kv_bytes=(256 << 20) if args.quick else (4 << 30), max_model_len=max(lengths) + m + 32,
              max_num_seqs=args.max_num_seqs)
    raw = {}
    with Engine(model_dir, "off", **kw) as e:
        off = e.batch(prompts, m)
        raw["off"] = {"seconds": off.seconds, "preemptions": off.preemptions}
        log(f"[off] {off.output_tokens} tokens in {off.seconds:.1f} s")
    for mode in ("naive", "vtoken"):
        with Engine(model_dir, mode, {"policy": "h2o", "collect_scores": True}, **kw) as e:
            b = e.batch([prompts[i] for _, _, i in combos], m, options)
            log(f"[{mode}] {len(combos)} requests, {b.output_tokens} tokens in {b.seconds:.1f} s, "
                f"{b.preemptions} preemptions")
            raw[mode] = {"seconds": b.seconds, "preemptions": b.preemptions, "engine": b.engine,
                         "records": [s.record for s in b.served]}
    bs = 32
    rows = []
    for k, (policy, budget, i) in enumerate(combos):
        nv, vt = raw["naive"]["records"][k], raw["vtoken"]["records"][k]
        off_mean, off_peak = off_blocks(lengths[i], m, bs)
        rows.append({"policy": policy, "budget": budget, "prompt_tokens": lengths[i],
                     "off_mean": off_mean, "off_peak": off_peak,
                     "naive_mean": nv["mean_retained_blocks"], "naive_peak": nv["peak_retained_blocks"],
                     "vtoken_mean": vt["mean_retained_blocks"], "vtoken_peak": vt["peak_retained_blocks"],
                     "floor_mean": vt["mean_floor_blocks"], "naive_model_mean": vt["mean_naive_retained_blocks"],
                     "live_tokens": vt["live_tokens"], "tokens_moved": vt["tokens_moved"],
                     "same_decisions": nv["live_tokens"] == vt["live_tokens"]})
    summary = []
    for policy in policies:
        for budget in budgets:
            rs = [r for r in rows if r["policy"] == policy and r["budget"] == budget]
            s = {k: float(sum(r[k] for r in rs)) for k in ("off_mean", "naive_mean", "vtoken_mean", "floor_mean",
                                                            "naive_peak", "vtoken_peak")}
            s.update(policy=policy, budget=budget, reduction=1 - s["vtoken_mean"] / s["naive_mean"],
                     peak_reduction=1 - s["vtoken_peak"] / s["naive_peak"],
                     gap_to_floor=(s["vtoken_mean"] - s["floor_mean"]) / len(rs))
            summary.append(s)
    red = [s["reduction"] for s in summary]
    log(f"vtoken holds {100 * min(red):.1f}-{100 * max(red):.1f}% fewer blocks than naive (time-averaged)")
    return {"model": model, "block_size": bs, "prompt_tokens": lengths, "max_tokens": m, "policies": policies,
            "budgets": budgets, "rows": rows, "summary": summary, "raw": raw,
            "reduction_range": [min(red), max(red)]}


def tables(result: dict) -> list[Table]:
    rows = [[s["policy"], s["budget"], s["off_mean"], s["naive_mean"], s["vtoken_mean"], s["floor_mean"],
             f"{100 * s['reduction']:.1f}%", f"{100 * s['peak_reduction']:.1f}%", round(s["gap_to_floor"], 2)]
            for s in result["summary"]]
    lo, hi = result["reduction_range"]
    return [Table(f"Retained KV blocks, time-averaged over decode, summed over {len(result['prompt_tokens'])} "
                  f"prompts of {'/'.join(map(str, result['prompt_tokens']))} tokens ({result['model']}, "
                  f"{result['max_tokens']} output tokens, block size {result['block_size']})",
                  ["policy", "budget", "off", "naive", "vtoken", "floor", "vtoken vs naive", "peak vs naive",
                   "vtoken - floor per request"], rows,
                  f"vtoken holds {100 * lo:.1f}-{100 * hi:.1f}% fewer blocks than naive (paper: 27.2-72.3%).")]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    budgets, policies = result["budgets"], result["policies"]
    x = np.arange(len(budgets))
    h2o = [s for s in result["summary"] if s["policy"] == policies[0]]
    for j, (key, label) in enumerate([("off_mean", "off"), ("naive_mean", "naive"), ("vtoken_mean", "vtoken"),
                                      ("floor_mean", "floor")]):
        ax1.bar(x + (j - 1.5) * 0.2, [s[key] for s in h2o], 0.2, label=label)
    ax1.set_xticks(x, [f"{b:g}" for b in budgets])
    ax1.set(xlabel="budget (live ratio)", ylabel="blocks (sum over prompts)", title=f"{policies[0]}: blocks held")
    ax1.legend()
    w = 0.8 / len(policies)
    for j, p in enumerate(policies):
        ax2.bar(x + (j - (len(policies) - 1) / 2) * w,
                [100 * s["reduction"] for s in result["summary"] if s["policy"] == p], w, label=p)
    ax2.axhspan(27.2, 72.3, color="grey", alpha=0.15, label="paper 27.2-72.3%")
    ax2.set_xticks(x, [f"{b:g}" for b in budgets])
    ax2.set(xlabel="budget (live ratio)", ylabel="% fewer blocks than naive", title="vtoken vs naive")
    ax2.legend(fontsize=8)
