"""Maximum feasible concurrency under a fixed, small KV pool: off / naive / vtoken, with eviction only after the
prompt (decode-only) or between prefill chunks too (prefill), at each budget.

A batch of N different prompts of the same length (real text) is submitted at once; prefix caching is off in
every mode, so no blocks are shared. Prompts are long against the outputs and read in chunks of
``--prefill-chunk`` tokens (the same chunks in every mode). It is *feasible* when all N were running together
at one moment (the last one scheduled before the first one finished, from vLLM's own per-request timestamps)
and no request was preempted. For each setting we search for the largest feasible N (starting from the setting
before it, which holds at least as much; then jumping to what the pool fits at the peak blocks a request held,
or doubling; then bisection) and report it with the batch's throughput there. With decode-only eviction every
request first holds its whole prompt, so the prompt decides the peak; with prefill eviction a request never
holds more than its budget plus one chunk. The pool is the same for every mode (``--pool-blocks``). One engine
per mode serves every budget and both eviction settings (per-request options).
"""

from __future__ import annotations

from vtoken.bench.engine_run import Engine, log, real_prompts
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET

MAX_N = 64


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policy", default="snapkv", help="the default policy")
    p.add_argument("--budgets", default=str(SHIPPED_BUDGET))
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pool-blocks", type=int, default=160, help="KV pool size in blocks of 32 tokens")
    p.add_argument("--prefill-chunk", type=int, default=64, help="tokens per prefill forward")
    p.add_argument(
        "--evict",
        choices=("always", "pressure"),
        default="pressure",
        help="eviction mode of naive and vtoken (pressure: the budget is a floor, shed only when the pool is short)",
    )
    p.add_argument(
        "--pressure-floor",
        type=float,
        default=0.0,
        help="naive and vtoken: pressure_floor (with --evict pressure: a request waits rather than push those running "
        "below this share of their tokens)",
    )
    p.add_argument(
        "--eviction",
        choices=("both", "prefill", "decode"),
        default="both",
        help="naive and vtoken with eviction between prefill chunks, decode-only, or both",
    )
    p.add_argument(
        "--no-off", action="store_true", help="skip mode off (its ratios are then missing); searches start at --start"
    )
    p.add_argument("--start", type=int, default=4, help="first N tried when mode off is skipped")
    p.add_argument(
        "--modes", default="naive,vtoken", help="which of naive and vtoken to search (without naive: no vs_naive)"
    )


def _block_bytes(model_dir: str, bs: int, dtype_bytes: int = 4) -> int:
    import json
    from pathlib import Path

    c = json.loads((Path(model_dir) / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head * bs * dtype_bytes


def _search(
    engine: Engine, prompts: list[list[int]], m: int, option: dict | None, start: int, label: str, max_n: int = MAX_N
) -> dict:
    pool = engine.total_blocks
    tried: dict[int, dict] = {}

    def feasible(n: int) -> bool:
        if n not in tried:
            b = engine.batch(prompts[:n], m, [option] * n)
            ok = b.all_concurrent and b.preemptions == 0
            tried[n] = {
                "n": n,
                "feasible": ok,
                "all_concurrent": b.all_concurrent,
                "preemptions": b.preemptions,
                "seconds": b.seconds,
                "tokens_per_s": b.output_tokens / b.seconds,
                "peak_blocks": max((x.record.get("peak_retained_blocks", 0) for x in b.served), default=0),
            }
            log(
                f"[{label}] N={n}: {'feasible' if ok else 'NOT feasible'} ({b.preemptions} preemptions, "
                f"all running together: {b.all_concurrent}), {b.output_tokens / b.seconds:.0f} tokens/s"
            )
        return tried[n]["feasible"]

    lo, hi = 0, None  # lo: largest known feasible, hi: smallest known infeasible
    n = max(start, 1)
    while hi is None and n <= max_n:
        if feasible(n):
            # next: double, or jump to what the pool fits at the peak blocks a request held (vToken's record)
            peak = tried[n].get("peak_blocks")
            guess = int(pool // peak) if peak else 0
            lo, n = n, guess if guess > n else n * 2
        else:
            hi = n
    hi = hi or max_n + 1
    if lo == 0:  # the start itself failed: look below it
        lo_n = 0
        for k in range(hi - 1, 0, -1):
            if feasible(k):
                lo_n = k
                break
        lo = lo_n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    best = tried.get(lo)
    return {
        "max_concurrency": lo,
        "tokens_per_s": best["tokens_per_s"] if best else 0.0,
        "ladder": sorted(tried.values(), key=lambda t: t["n"]),
    }


SETTINGS = (("naive", False), ("naive", True), ("vtoken", False), ("vtoken", True))  # (mode, prefill_evict)


def _label(mode: str, prefill: bool | None) -> str:
    return mode if prefill is None else f"{mode} ({'prefill' if prefill else 'decode-only'})"


def run(args) -> dict:
    from vtoken.models import model_path

    if args.quick:
        model, budgets, plen, m, pool, max_n, chunk = "tiny-llama", [0.25], 256, 32, 36, 6, 64
    else:
        model, budgets, plen, m, pool, max_n, chunk = (
            args.model,
            [float(b) for b in args.budgets.split(",")],
            args.prompt_tokens,
            args.max_tokens,
            args.pool_blocks,
            MAX_N,
            args.prefill_chunk,
        )
    model_dir = str(model_path(model))
    prompts = real_prompts(model_dir, MAX_N, plen)
    kv = (pool + 1) * _block_bytes(model_dir, 32)  # + vLLM's reserved null block
    kw = dict(kv_bytes=kv, max_model_len=plen + m + 64, max_num_seqs=MAX_N, enable_prefix_caching=False)
    results = []
    evict = args.evict
    prefills = {"both": (False, True), "prefill": (True,), "decode": (False,)}[args.eviction]
    if args.no_off:
        start = {b: args.start for b in budgets}
    else:
        with Engine(model_dir, "off", {"prefill_chunk": chunk}, **kw) as e:
            pool = e.total_blocks
            results.append(
                {"mode": "off", "prefill_evict": None, "budget": 1.0, **_search(e, prompts, m, None, 1, "off", max_n)}
            )
        start = {b: results[0]["max_concurrency"] for b in budgets}
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"naive", "vtoken"}:
        raise SystemExit(f"--modes: choose from naive, vtoken (got {args.modes!r})")
    for mode in [m for m in ("naive", "vtoken") if m in modes]:
        cfg = {"policy": args.policy, "prefill_chunk": chunk, "pressure_floor": args.pressure_floor}
        with Engine(model_dir, mode, cfg, **kw) as e:
            pool = e.total_blocks
            for b in budgets:
                for prefill in prefills:
                    opt = {"budget": b, "prefill_evict": prefill, "evict": evict}
                    r = _search(e, prompts, m, opt, start[b], f"{_label(mode, prefill)} {b}", max_n)
                    start[b] = min(start[b], r["max_concurrency"]) if mode == "naive" else r["max_concurrency"]
                    results.append({"mode": mode, "prefill_evict": prefill, "budget": b, **r})
    off = results[0]["max_concurrency"] if results[0]["mode"] == "off" else None
    for r in results:
        naive = next(
            (
                x
                for x in results
                if x["mode"] == "naive" and x["budget"] == r["budget"] and x["prefill_evict"] == r["prefill_evict"]
            ),
            None,
        )
        r["vs_off"] = r["max_concurrency"] / off if off else None
        r["vs_naive"] = r["max_concurrency"] / naive["max_concurrency"] if naive and naive["max_concurrency"] else None
    return {
        "model": model,
        "policy": args.policy,
        "prompt_tokens": plen,
        "max_tokens": m,
        "prefill_chunk": chunk,
        "pool_blocks": pool,
        "budgets": budgets,
        "evict": evict,
        "pressure_floor": args.pressure_floor,
        "results": results,
    }


def _peak_at_max(r: dict) -> int | str:
    """The most one request held in the batch of the largest feasible N (the rung the row reports), not the
    largest over every rung: a smaller batch sheds later, so its requests hold more."""
    if r["mode"] == "off":
        return "-"
    return next((t["peak_blocks"] for t in r["ladder"] if t["feasible"] and t["n"] == r["max_concurrency"]), "-")


def tables(result: dict) -> list[Table]:
    rows = [
        [
            _label(r["mode"], r.get("prefill_evict")),
            r["budget"] if r["mode"] != "off" else "-",
            r["max_concurrency"],
            round(r["tokens_per_s"], 1),
            _peak_at_max(r),
            f"x{r['vs_naive']:.2f}" if r["vs_naive"] else "-",
            f"x{r['vs_off']:.2f}" if r["vs_off"] else "-",
        ]
        for r in result["results"]
    ]
    return [
        Table(
            f"Maximum feasible concurrency in a {result['pool_blocks']}-block pool ({result['model']}, "
            f"{result['policy']}, {result['prompt_tokens']}-token prompts read in chunks of "
            f"{result.get('prefill_chunk')}, {result['max_tokens']} output tokens, "
            f"evict: {result.get('evict', 'always')}"
            + (f", pressure floor {result['pressure_floor']:g}" if result.get("pressure_floor") else "")
            + ")",
            [
                "eviction",
                "budget",
                "max concurrent requests",
                "tokens/s at that point",
                "peak blocks per request",
                "vs naive (same eviction)",
                "vs off",
            ],
            rows,
            "Feasible: all requests running together, no preemption. Peak blocks: the "
            "most one request held at the largest feasible N (vToken's record; off has none).",
        )
    ]


def plot(result: dict, fig) -> None:
    import numpy as np

    ax = fig.subplots(1, 1)
    budgets = result["budgets"]
    x = np.arange(len(budgets))
    first = result["results"][0]
    off = first["max_concurrency"] if first["mode"] == "off" else None
    settings = [
        (mode, prefill)
        for mode, prefill in SETTINGS
        if any(r["mode"] == mode and r.get("prefill_evict") == prefill for r in result["results"])
    ]
    w = 0.8 / len(settings)
    for j, (mode, prefill) in enumerate(settings):
        vals = [
            next(
                r["max_concurrency"]
                for r in result["results"]
                if r["mode"] == mode and r["budget"] == b and r.get("prefill_evict") == prefill
            )
            for b in budgets
        ]
        ax.bar(x + (j - (len(settings) - 1) / 2) * w, vals, w, label=_label(mode, prefill))
    if off is not None:
        ax.axhline(off, color="k", ls="--", label="off")
    ax.set_xticks(x, [f"{b:g}" for b in budgets])
    ax.set(
        xlabel="budget (live ratio)",
        ylabel="max concurrent requests, no preemption",
        title=f"{result['pool_blocks']}-block KV pool, {result['prompt_tokens']}-token prompts",
    )
    ax.legend(fontsize=8)
