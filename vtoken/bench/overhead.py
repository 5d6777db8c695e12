"""Overhead of vToken against stock vLLM on SmolLM2, modes interleaved in rounds, medians with their spread.

Modes (same prompts, every request generates the same number of tokens):
  stock            vllm.LLM as users start it, no vToken import in the engine
  off              make_llm(mode="off"): must equal stock (no regression)
  vtoken-noevict   vToken's scheduler and worker in the path, budget above any context: bookkeeping only
  vtoken-streaming eviction + compaction + KV moves, no attention scoring
  vtoken-h2o       the same plus attention scoring at every decode step (the h2o policy)
  vtoken-snapkv    snapkv at its budget (evict always), decisions in block-sized batches, scores on demand from a
                   window of recent queries (no per-step scorer)
  vtoken-default   the engine's defaults (snapkv, evict pressure with the tier): evicts only when the pool runs short
  naive-h2o        Naive-Evict with the same decisions
  vtoken-h2o-every4  h2o with score_every=4 (opt-in): one decode step in four observed
Step time is vLLM's own per-request decode time, (last token - first token) / (tokens - 1). Every round
runs every mode once (the order rotates from round to round, so slow drift hits every mode alike); ratios
are taken within a round and reported as the median over rounds with their [min, max], so a noisy machine
shows as a wide spread instead of a wrong number. The scoring share is (h2o - streaming) / h2o: both evict
to the same budget, so they attend to the same live-token counts and differ only by the scorer. Each mode also
reports its measured scoring share: the worker's host time scoring (per-step scorer, chunk windows, windows on
demand) over the batch's time.

Also: a scorer micro-benchmark (its time per decode step at three context lengths, SmolLM2's shapes, to
show it grows linearly with live tokens; ``python -m vtoken.bench.overhead --device cuda`` runs it alone,
without vLLM), the mover's bandwidth against a plain copy, and TokenTable bytes per token (``bench core``).
"""

from __future__ import annotations

import os
import time

import numpy as np

from vtoken.bench.engine_run import Engine, log, real_prompts
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET

CORE_MODES = ("off", "vtoken-snapkv", "vtoken-streaming", "vtoken-h2o", "naive-h2o", "vtoken-h2o-every4")
ALL_MODES = (
    "stock", "off", "vtoken-noevict", "vtoken-default", "vtoken-snapkv", "vtoken-streaming", "vtoken-h2o", "naive-h2o",
    "vtoken-h2o-every4",
)  # fmt: skip
# --quick: a smoke run of the path each kind of mode takes (an engine start is about 10 s on 2 cores)
QUICK_MODES = ("stock", "vtoken-default", "naive-h2o")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET)
    p.add_argument("--rounds", type=int, default=5, help="every mode runs once per round")
    p.add_argument("--modes", default=",".join(CORE_MODES), help=f"comma-separated, of {','.join(ALL_MODES)}")


def step_seconds(first_ts: float, last_ts: float, tokens: int) -> float:
    """vLLM's per-request decode step time: first to last token over the steps between them."""
    return (last_ts - first_ts) / max(tokens - 1, 1)


def _modes(budget: float) -> dict[str, tuple[str, dict | None]]:
    return {
        "stock": ("stock", None),
        "off": ("off", None),
        "vtoken-noevict": ("vtoken", {"policy": "streaming", "budget": 10**9}),
        "vtoken-default": ("vtoken", {"evict": "pressure", "park_tokens": "auto", "budget": budget}),
        "vtoken-snapkv": ("vtoken", {"policy": "snapkv", "budget": budget}),
        "vtoken-streaming": ("vtoken", {"policy": "streaming", "budget": budget}),
        "vtoken-h2o": ("vtoken", {"policy": "h2o", "budget": budget}),
        "naive-h2o": ("naive", {"policy": "h2o", "budget": budget}),
        # the opt-in cheaper scoring: one decode step in four observed (quality cost: vtoken bench quality)
        "vtoken-h2o-every4": ("vtoken", {"policy": "h2o", "budget": budget, "policy_params": {"score_every": 4}}),
    }


def _stock_batch(model_dir: str, prompts, m: int, kw: dict):
    """Stock vLLM without make_llm, timed like the others."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import shutdown_llm

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
        shutdown_llm(llm)
    steps = [step_seconds(o.metrics.first_token_ts, o.metrics.last_token_ts, len(o.outputs[0].token_ids)) for o in outs]
    return seconds, float(np.mean(steps)), {}


def _run_mode(label: str, mode: str, cfg: dict | None, model_dir: str, prompts, m: int, kw: dict) -> dict:
    load = os.getloadavg()[0]
    if mode == "stock":
        seconds, step, engine = _stock_batch(model_dir, prompts, m, kw)
    else:
        with Engine(model_dir, mode, cfg, **kw) as e:
            b = e.batch(prompts, m)
        seconds, engine = b.seconds, b.engine
        step = float(np.mean([step_seconds(s.first_token_ts, s.last_token_ts, len(s.output_tokens)) for s in b.served]))
    log(f"[{label}] {seconds:.1f} s, {1000 * step:.1f} ms per decode step (load {load:.1f})")
    return {
        "seconds": seconds,
        "ms_per_step": 1000 * step,
        "load_before": load,
        "compaction_seconds": engine.get("compaction_seconds", 0.0),
        "move_seconds": engine.get("move_seconds", 0.0),
        "score_seconds": engine.get("score_seconds", 0.0),
        "tokens_moved": engine.get("tokens_moved", 0),
    }


def _spread(name: str, xs) -> dict[str, float | list[float]]:
    """``{name: median, name_range: [min, max]}`` of one figure over the rounds."""
    xs = np.asarray(list(xs), dtype=float)
    return {name: float(np.median(xs)), f"{name}_range": [float(xs.min()), float(xs.max())]}


def summarise(rounds: list[dict[str, dict]], modes: list[str]) -> dict:
    """Per-round ratios (each round's modes ran back to back), then their median and [min, max]."""
    base = "off" if "off" in modes else modes[0]
    rows = []
    for mode in modes:
        runs = [r[mode] for r in rounds]
        rows.append(
            {
                "mode": mode,
                **_spread("ms_per_step", (x["ms_per_step"] for x in runs)),
                **_spread(f"ratio_to_{base}", (r[mode]["ms_per_step"] / r[base]["ms_per_step"] for r in rounds)),
                "compaction_share": float(np.median([x["compaction_seconds"] / x["seconds"] for x in runs])),
                "move_share": float(np.median([x["move_seconds"] / x["seconds"] for x in runs])),
                "score_share": float(np.median([x.get("score_seconds", 0.0) / x["seconds"] for x in runs])),
                "tokens_moved": int(np.median([x["tokens_moved"] for x in runs])),
            }
        )
    out = {"base": base, "rows": rows}
    if "vtoken-streaming" in modes:
        stream = [r["vtoken-streaming"]["ms_per_step"] for r in rounds]
        if "vtoken-h2o" in modes:
            h2o = [r["vtoken-h2o"]["ms_per_step"] for r in rounds]
            out.update(_spread("scoring_share", ((h - s) / h for h, s in zip(h2o, stream))))
            out.update(_spread("h2o_over_streaming", (h / s for h, s in zip(h2o, stream))))
        if "vtoken-h2o-every4" in modes:
            every = [r["vtoken-h2o-every4"]["ms_per_step"] for r in rounds]
            out.update(_spread("scoring_share_every4", ((h - s) / h for h, s in zip(every, stream))))
    return out


# ---------------------------------------------------------------------------------- scorer micro-benchmark
def scorer_micro(
    device: str = "cpu",
    lengths: tuple[int, ...] = (256, 1024, 4096),
    requests: int = 4,
    repeats: int = 7,
    dtype: str = "float32",
    window: int = 32,
) -> dict:
    """The scorer alone, per step, on SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads of 64, blocks of
    32): ``requests`` decode rows of each context length, plus one prefill chunk's ``window``-query window
    at the middle length. Median and best of ``repeats`` steps; least-squares fit of the best: a + b * tokens."""
    import torch

    from vtoken.kv.scores import AttentionScorer

    layers, heads, kv_heads, d, bs = 30, 9, 3, 64, 32
    dev, dt = torch.device(device), getattr(torch, dtype)
    layout = "cpu" if dev.type == "cpu" else "flash"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device=dev).manual_seed(0)  # the KV is drawn where it lives: no host copy of GBs

    def timed(n: int, rows: int, n_q: int) -> tuple[float, float]:
        nb = rows * -(-n // bs) + 1
        shape = (nb, kv_heads, bs * 2 * d) if layout == "cpu" else (nb, kv_heads, bs, 2 * d)
        kv = [torch.randn(shape, generator=gd, device=dev).to(dt) for _ in range(layers)]
        table = torch.randperm(nb - 1, generator=g)[: rows * -(-n // bs)].view(rows, -1)
        md = type("Metadata", (), {})()
        md.query_start_loc = (torch.arange(rows + 1) * n_q).to(dev, torch.int32)
        md.seq_lens = torch.full((rows,), n, dtype=torch.int32, device=dev)
        md.block_table, md.max_seq_len = table.to(dev, torch.int32), n
        q = torch.randn(rows * n_q, heads, d, generator=g).to(dev, dt)
        scorer = AttentionScorer(nb * bs, bs, layout, dev)

        def step() -> None:
            scorer.begin_step(np.arange(rows), np.full(rows, n_q))
            for layer in kv:
                scorer.observe(q, layer, md, d**-0.5)
            scorer.end_step()

        step()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        return 1000 * float(np.median(times)), 1000 * float(np.min(times))

    points = []
    for n in lengths:
        ms, best = timed(n, requests, 1)
        points.append({"context": n, "live_tokens": n * requests, "ms_per_step": ms, "ms_min": best})
        log(f"[scorer] {requests} decode rows x {n} tokens: {ms:.2f} ms per step (best {best:.2f})")
    # The fit uses each length's best step: what the work costs when no other process takes the cores.
    live = np.array([p["live_tokens"] for p in points], dtype=float)
    best = np.array([p["ms_min"] for p in points])
    slope, intercept = np.polyfit(live, best, 1)
    for p in points:
        p["fit_error"] = float(p["ms_min"] / (intercept + slope * p["live_tokens"]) - 1)
    mid = lengths[len(lengths) // 2]
    win = timed(mid, 1, window)[0]
    log(f"[scorer] one {window}-query prefill window over {mid} tokens: {win:.2f} ms")
    return {
        "device": device,
        "dtype": dtype,
        "requests": requests,
        "points": points,
        "fit": {"ms_fixed": float(intercept), "ms_per_1k_tokens": float(1e3 * slope)},
        "window": {"queries": window, "context": mid, "ms": win},
        "threads": torch.get_num_threads(),
        "load": os.getloadavg()[0],
    }


def window_micro(
    device: str = "cpu",
    lengths: tuple[int, ...] = (256, 1024, 4096),
    requests: int = 4,
    repeats: int = 5,
    dtype: str = "float32",
    shapes: str = "smollm2-135m",
    block: int = 32,
    budget: float = SHIPPED_BUDGET,
) -> dict:
    """The default's decode scoring against the per-step scorer, per decode step, on a model's shapes: the window of
    recent queries (vtoken/kv/query_window.py) written every step and scored once per decision, a decision about every
    ``block / (1 - budget)`` steps, amortised over them; the per-step scorer (vtoken/kv/scores.py) scores every step."""
    import torch

    from vtoken.bench.attention_stack import SHAPES
    from vtoken.bench.core import _best
    from vtoken.kv.query_window import QueryWindow
    from vtoken.kv.scores import AttentionScorer

    s, bs = SHAPES[shapes], 32 if device == "cpu" else 16
    dev, dt = torch.device(device), getattr(torch, dtype)
    layout = "cpu" if dev.type == "cpu" else "flash"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gd = torch.Generator(device=dev).manual_seed(0)
    every = max(1, round(block / (1 - budget)))  # decode steps between two decisions
    out = []
    for n in lengths:
        nb = requests * -(-n // bs) + 1
        shape = (nb, s.kv_heads, bs * 2 * s.head_size) if layout == "cpu" else (nb, s.kv_heads, bs, 2 * s.head_size)
        kv = [torch.randn(shape, generator=gd, device=dev).to(dt) for _ in range(s.layers)]
        table = torch.arange(nb - 1, device=dev)[: requests * -(-n // bs)].view(requests, -1)
        md = type("Metadata", (), {})()
        md.query_start_loc = torch.arange(requests + 1, device=dev, dtype=torch.int32)
        md.seq_lens = torch.full((requests,), n, dtype=torch.int32, device=dev)
        md.block_table, md.max_seq_len = table.to(torch.int32), n
        q = torch.randn(requests, s.heads, s.head_size, generator=gd, device=dev).to(dt)
        scorer = AttentionScorer(nb * bs, bs, layout, dev)
        window = QueryWindow(requests, kv, layout, bs, s.heads, s.head_size, 16)
        rows = [window.row_of(str(r)) for r in range(requests)]
        blocks = [table[r].tolist() for r in range(requests)]

        def per_step(scorer=scorer, kv=kv, q=q, md=md) -> None:
            scorer.begin_step(np.arange(requests), np.ones(requests, np.int64))
            for layer in kv:
                scorer.observe(q, layer, md, s.head_size**-0.5)
            scorer.end_step()

        def record(window=window, rows=rows, kv=kv, q=q, md=md, n=n) -> None:
            window.begin([(r, i, n - 1) for i, r in enumerate(rows)])
            for layer in kv:
                window.record(q, layer, md, s.head_size**-0.5)

        def decide(window=window, rows=rows, blocks=blocks, kv=kv, n=n) -> None:
            for r, b in zip(rows, blocks):
                window.score(r, b, n, kv)

        def timed(fn) -> float:
            fn()  # warm-up
            return 1000 * _best(fn, repeats, sync)

        step, rec, dec = timed(per_step), timed(record), timed(decide)
        out.append({"context": n, "per_step_ms": step, "window_record_ms": rec, "window_score_ms": dec,
                    "window_ms_per_step": rec + dec / every})  # fmt: skip
        log(f"[window] {requests} x {n} tokens ({shapes}): per-step scorer {step:.2f} ms a step; window "
            f"{rec:.3f} ms a step + {dec:.2f} ms a decision every {every} steps")  # fmt: skip
    return {"device": device, "dtype": dtype, "shapes": shapes, "requests": requests, "steps_per_decision": every,
            "points": out}  # fmt: skip


# ---------------------------------------------------------------------------------- the benchmark
def run(args) -> dict:
    from vtoken.bench import core
    from vtoken.models import model_path

    model = "tiny-llama" if args.quick else args.model
    n, plen, m = (2, 128, 16) if args.quick else (args.prompts, args.prompt_tokens, args.max_tokens)
    modes = list(QUICK_MODES) if args.quick else [x.strip() for x in args.modes.split(",") if x.strip()]
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {','.join(ALL_MODES)}")
    n_rounds = 1 if args.quick else args.rounds  # --quick: a smoke run (every mode once)
    model_dir = str(model_path(model))
    prompts = real_prompts(model_dir, n, plen)
    kw = dict(kv_bytes=1 << 30, max_model_len=plen + m + 32)
    table = _modes(args.budget)
    rounds = []
    for i in range(n_rounds):
        order = modes[i % len(modes) :] + modes[: i % len(modes)]  # rotate: drift hits every mode alike
        log(f"[round {i + 1}/{n_rounds}] {', '.join(order)}")
        rounds.append({label: _run_mode(label, *table[label], model_dir, prompts, m, kw) for label in order})
    summary = summarise(rounds, modes)
    micro = scorer_micro(lengths=(128, 256, 512) if args.quick else (256, 1024, 4096), repeats=5 if args.quick else 9)
    window = window_micro(
        lengths=(128, 256) if args.quick else (256, 1024, 4096), repeats=3 if args.quick else 5, budget=args.budget
    )
    args_core = type("A", (), {"quick": args.quick, "tokens": 16384, "moves": 4096, "repeats": 10, "device": "cpu"})
    return {
        "model": model,
        "prompts": n,
        "prompt_tokens": plen,
        "max_tokens": m,
        "budget": args.budget,
        "modes": modes,
        "rounds": rounds,
        **summary,
        "scorer": micro,
        "window": window,
        "core": core.run(args_core),
    }


def _fmt(d: dict, name: str, pct: bool = False, fmt: str = ".1f") -> str:
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: format(x, fmt))
    lo, hi = d[f"{name}_range"]
    return f"{f(d[name])} [{f(lo)}, {f(hi)}]"


def tables(result: dict) -> list[Table]:
    base = result["base"]
    rows = [
        [
            r["mode"],
            _fmt(r, "ms_per_step"),
            _fmt(r, f"ratio_to_{base}", fmt=".3f"),
            f"{100 * r['compaction_share']:.2f}%",
            f"{100 * r['move_share']:.2f}%",
            f"{100 * r['score_share']:.2f}%" if "score_share" in r else "-",  # runs before it was measured
            r["tokens_moved"],
        ]
        for r in result["rows"]
    ]
    loads = [x["load_before"] for rnd in result["rounds"] for x in rnd.values()]
    note = (
        f"{len(result['rounds'])} rounds; 1-minute load average {min(loads):.1f} to {max(loads):.1f} on this machine."
    )
    if "scoring_share" in result:
        note += (
            f" Attention scoring, (h2o - streaming) / h2o at the same budget: {_fmt(result, 'scoring_share', True)}"
            f" of h2o's step; h2o / streaming: x{_fmt(result, 'h2o_over_streaming', fmt='.3f')}."
        )
    if "scoring_share_every4" in result:
        note += f" With score_every=4 (opt-in): {_fmt(result, 'scoring_share_every4', True)} of its step."
    s = result["scorer"]
    scorer_rows = [
        [
            p["context"],
            p["live_tokens"],
            round(p["ms_per_step"], 2),
            round(p["ms_min"], 2),
            f"{100 * p['fit_error']:+.0f}%",
        ]
        for p in s["points"]
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
            f"Decode step time, median [min, max] over rounds ({result['model']}, {result['prompts']} x "
            f"{result['prompt_tokens']}-token prompts, {result['max_tokens']} output tokens, budget "
            f"{result['budget']})",
            ["mode", "ms/step", f"vs {base}", "scheduler compaction", "KV moves", "scoring", "tokens moved"],
            rows,
            note,
        ),
        Table(
            f"Scorer alone per decode step ({s['device']}, {s['dtype']}, {s['requests']} requests, SmolLM2 shapes, "
            f"{s['threads']} threads)",
            ["context", "live tokens", "ms/step (median)", "best", "best vs linear fit"],
            scorer_rows,
            f"Fit of the best steps: {s['fit']['ms_fixed']:.2f} ms + {s['fit']['ms_per_1k_tokens']:.3f} ms per 1k "
            f"live tokens (load {s['load']:.1f}). "
            f"One {s['window']['queries']}-query prefill window over {s['window']['context']} tokens: "
            f"{s['window']['ms']:.2f} ms.",
        ),
        Table("Core figures", ["figure", "value"], micro),
    ]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    rows = result["rows"]
    med = [r["ms_per_step"] for r in rows]
    err = [
        [m - r["ms_per_step_range"][0] for m, r in zip(med, rows)],
        [r["ms_per_step_range"][1] - m for m, r in zip(med, rows)],
    ]
    ax1.bar([r["mode"] for r in rows], med, yerr=err, color="tab:blue", capsize=4)
    ax1.set(ylabel="ms per decode step (median, min-max)", title=f"vToken overhead on {result['model']}")
    ax1.tick_params(axis="x", rotation=20)
    pts = result["scorer"]["points"]
    ax2.plot([p["live_tokens"] for p in pts], [p["ms_per_step"] for p in pts], "o-")
    ax2.set(xlabel="live tokens in the batch", ylabel="scorer ms per step", title="scorer cost vs live tokens")


def main(argv=None) -> None:
    """The scorer micro-benchmark alone (no vLLM needed): ``python -m vtoken.bench.overhead --device cuda``."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--window", action="store_true", help="the on-demand window against the per-step scorer instead")
    p.add_argument("--shapes", default="smollm2-135m", help="with --window: smollm2-135m or llama-8b")
    a = p.parse_args(argv)
    lengths = tuple(int(x) for x in a.lengths.split(","))
    if a.window:
        result = window_micro(a.device, lengths, repeats=a.repeats, dtype=a.dtype, shapes=a.shapes)
    else:
        result = scorer_micro(a.device, lengths, repeats=a.repeats, dtype=a.dtype)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
