"""SLA-constrained throughput: Poisson arrivals at increasing rates against a small KV pool.

For each mode (off, naive, vtoken; naive and vtoken with the same policy and budget, evicting between
prefill chunks too) one AsyncLLM engine serves ``--requests`` requests per rate, arriving as a Poisson process
(fixed seed, the same arrival times in every mode). Time to first token (TTFT) and time per output token (TPOT)
are measured by the client, as users see them. A rate *meets the SLA* when p90 TTFT and p90 TPOT are both
within it. Each mode climbs a geometric ladder of rates (``--start-rate`` times ``--rate-step`` per rung) until
it misses the SLA, so the ladder never caps a mode (``--max-rate`` only stops a runaway; a mode that reaches it
is reported as such). Per mode we report the highest rate within the SLA and the goodput there: requests per
second that met the SLA individually (TTFT and TPOT each within it), over the time from the first arrival to the
last completion.

``--workload retrieval`` sends the needle suite's prompts instead (vtoken/bench/needles.py, the 1K-token
prompts: a question about a fact hidden in the text) and counts, besides goodput, the *served-correct goodput*:
requests per second that met the SLA AND retrieved their needle. Memory bought by evicting the needle is
throughput that answers wrongly; this is the figure that shows it.

The SLA is derived on this machine, in this run, from the off engine serving one request alone:
TTFT <= ``--ttft-factor`` x its TTFT, and TPOT <= ``--tpot-factor`` x its TPOT - a request may wait a
few prefills' worth and decode may slow down by batching, but not without bound. The pool is small on
purpose (``--pool-blocks``): memory, which vToken reclaims, is what limits the rate, not the two cores.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from vtoken.bench.concurrency import _block_bytes
from vtoken.bench.engine_run import log, real_prompts
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policy", default="snapkv", help="the default policy")
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--pool-blocks", type=int, default=40)
    p.add_argument("--requests", type=int, default=60, help="requests per rate")
    p.add_argument("--start-rate", type=float, default=0.5, help="first rung of the ladder, requests per second")
    p.add_argument("--rate-step", type=float, default=1.5, help="each rung's rate is the last one's times this")
    p.add_argument("--max-rate", type=float, default=40.0, help="stop climbing here even within the SLA")
    p.add_argument("--prefill-chunk", type=int, default=64, help="tokens per prefill forward (every mode)")
    p.add_argument("--ttft-factor", type=float, default=10.0)
    p.add_argument("--tpot-factor", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=("tokens", "retrieval"), default="tokens")
    p.add_argument("--evict", choices=("always", "pressure"), default="pressure", help="naive and vtoken")
    p.add_argument(
        "--pressure-floor",
        type=float,
        default=0.0,
        help="naive and vtoken: pressure_floor (a request waits rather than push those running below this share)",
    )
    p.add_argument(
        "--park-tokens",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="the parking tier of naive and vtoken: auto (the engine's default: on a CPU four times the pool's "
        "tokens), a token count, or 0 (none)",
    )


async def _one(engine, prompt, sp, rid: str, delay: float) -> dict:
    from vllm.inputs import TokensPrompt

    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    first = last = None
    n, text = 0, ""
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
        n, text = len(out.outputs[0].token_ids), out.outputs[0].text
        if n and first is None:
            first = time.perf_counter()
        last = time.perf_counter()
    return {"ttft": first - t0, "tpot": (last - first) / max(n - 1, 1), "tokens": n, "end": last, "text": text}


async def _serve(engine, prompts, sp, arrivals, tag: str, sla: dict | None = None, answers=None) -> dict:
    """``answers``: each prompt's needle (retrieval workload): a request counts as served-correct when it met
    the SLA and retrieved it."""
    from vtoken.bench.needles import hit

    t0 = time.perf_counter()
    res = await asyncio.gather(
        *(_one(engine, p, sp, f"{tag}-{i}", a) for i, (p, a) in enumerate(zip(prompts, arrivals)))
    )
    span = max(r["end"] for r in res) - t0
    ok = [r["ttft"] <= sla["ttft"] and r["tpot"] <= sla["tpot"] for r in res] if sla else [True] * len(res)
    met = sum(ok)
    right = [hit(a, r["text"]) for a, r in zip(answers, res)] if answers else None
    extra = {}
    if right is not None:
        extra = {"correct": int(sum(right)), "correct_goodput": sum(o and c for o, c in zip(ok, right)) / span}
    return {
        **extra,
        "p90_ttft": float(np.percentile([r["ttft"] for r in res], 90)),
        "p90_tpot": float(np.percentile([r["tpot"] for r in res], 90)),
        "throughput": len(res) / span,
        "goodput": met / span,
        "met_sla": int(met),
        "tokens_per_s": sum(r["tokens"] for r in res) / span,
        "requests": res,
    }


def ladder(start: float, step: float, top: float) -> list[float]:
    """start, start * step, ... up to top (rounded to 3 significant digits so the JSON reads well)."""
    rates, r = [], start
    while r <= top * (1 + 1e-9):
        rates.append(float(f"{r:.3g}"))
        r *= step
    return rates


async def _mode(
    model_dir: str,
    mode: str,
    cfg: dict,
    kw: dict,
    prompts,
    m: int,
    rates,
    n: int,
    seed: int,
    sla: dict | None,
    factors: tuple[float, float],
    answers: list[str] | None = None,
) -> dict:
    """Serve the rates in order until one misses the SLA. ``sla=None`` (the off engine, first): derive
    the SLA from this engine's solo request."""
    from vllm import SamplingParams

    from vtoken.vllm_adapter import make_async_llm, vtoken_stats_async

    log(f"[{mode}] starting vLLM ...")
    engine = make_async_llm(model_dir, {"mode": mode, **cfg} if mode != "off" else {"mode": "off"}, **kw)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        solo = await _serve(engine, prompts[:1], sp, [0.0], f"{mode}-solo")
        if sla is None:
            sla = {"ttft": factors[0] * solo["p90_ttft"], "tpot": factors[1] * solo["p90_tpot"]}
            log(f"SLA: p90 TTFT <= {sla['ttft']:.2f} s, p90 TPOT <= {1000 * sla['tpot']:.0f} ms")
        out = {"solo": {k: v for k, v in solo.items() if k != "requests"}, "sla": sla, "rates": []}
        for rate in rates:
            rng = np.random.default_rng(seed)
            arrivals = np.cumsum(rng.exponential(1.0 / rate, n)).tolist()
            r = await _serve(engine, prompts[:n], sp, arrivals, f"{mode}-{rate}", sla, answers and answers[:n])
            r["rate"] = rate
            r["meets_sla"] = r["p90_ttft"] <= sla["ttft"] and r["p90_tpot"] <= sla["tpot"]
            if mode != "off":
                r["preemptions_seen"] = (await vtoken_stats_async(engine))["preemptions_seen"]
            out["rates"].append({k: v for k, v in r.items() if k != "requests"})
            log(
                f"[{mode}] {rate} req/s: p90 TTFT {r['p90_ttft']:.2f} s, p90 TPOT {1000 * r['p90_tpot']:.0f} ms, "
                f"{r['throughput']:.2f} req/s, goodput {r['goodput']:.2f} req/s "
                f"-> {'meets' if r['meets_sla'] else 'misses'} the SLA"
            )
            if not r["meets_sla"]:
                break
        ok = [r for r in out["rates"] if r["meets_sla"]]
        out["max_rate"] = ok[-1]["rate"] if ok else 0.0
        out["throughput_at_max"] = ok[-1]["throughput"] if ok else 0.0
        out["goodput_at_max"] = ok[-1]["goodput"] if ok else 0.0
        if answers:
            out["correct_goodput_at_max"] = ok[-1]["correct_goodput"] if ok else 0.0
            out["best_correct_goodput"] = max(r["correct_goodput"] for r in out["rates"])
        out["broke_sla"] = bool(out["rates"]) and not out["rates"][-1]["meets_sla"]
        return out
    finally:
        engine.shutdown()


def run(args) -> dict:
    from vtoken.models import model_path

    if args.quick:
        model, plen, m, pool, n, rates, chunk = "tiny-llama", 64, 32, 16, 6, [8.0], 32  # one rung: a smoke run
    else:
        model, plen, m, pool, n = args.model, args.prompt_tokens, args.max_tokens, args.pool_blocks, args.requests
        rates, chunk = ladder(args.start_rate, args.rate_step, args.max_rate), args.prefill_chunk
    model_dir = str(model_path(model))
    answers = None
    if args.workload == "retrieval":
        from transformers import AutoTokenizer

        from vtoken.bench.needles import build

        suite = build(AutoTokenizer.from_pretrained(model_dir), [256 if args.quick else 1024], 3 if args.quick else 12)
        suite = [suite[i % len(suite)] for i in range(n)]
        prompts, answers, plen = [c.prompt for c in suite], [c.answer for c in suite], len(suite[0].prompt)
    else:
        prompts = real_prompts(model_dir, n, plen)
    kw = dict(
        dtype="float32",
        block_size=32,
        kv_cache_memory_bytes=(pool + 1) * _block_bytes(model_dir, 32),
        max_model_len=plen + m + 64,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=False,
        max_num_seqs=64,
        disable_log_stats=False,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=chunk,  # every mode reads prompts in the same chunks
    )
    cfg = {"policy": args.policy, "budget": args.budget, "prefill_chunk": chunk, "evict": args.evict,
           "park_tokens": args.park_tokens, "pressure_floor": args.pressure_floor}  # fmt: skip
    factors = (args.ttft_factor, args.tpot_factor)
    common = (model_dir, cfg, kw, prompts, m, rates, n, args.seed)
    modes = {"off": asyncio.run(_mode(common[0], "off", *common[1:], None, factors, answers))}
    sla = modes["off"]["sla"]  # from off serving one request alone, first in this run
    for mode in ("naive", "vtoken"):
        modes[mode] = asyncio.run(_mode(common[0], mode, *common[1:], sla, factors, answers))
    nv, vt = modes["naive"]["max_rate"], modes["vtoken"]["max_rate"]
    base = modes["naive"]["goodput_at_max"]
    for r in modes.values():
        r["goodput_vs_naive"] = r["goodput_at_max"] / base if base else None
    return {
        "workload": args.workload,
        "evict": args.evict,
        "park_tokens": args.park_tokens,
        "pressure_floor": args.pressure_floor,
        "model": model,
        "policy": args.policy,
        "budget": args.budget,
        "prompt_tokens": plen,
        "max_tokens": m,
        "pool_blocks": pool,
        "requests_per_rate": n,
        "prefill_chunk": chunk,
        "rates": rates,
        "sla": sla,
        "solo": modes["off"]["solo"],
        "modes": modes,
        "ratio_vs_naive": vt / nv if nv else None,
        "throughput_ratio_vs_naive": (
            modes["vtoken"]["throughput_at_max"] / modes["naive"]["throughput_at_max"]
            if modes["naive"]["throughput_at_max"]
            else None
        ),
    }


def tables(result: dict) -> list[Table]:
    rows = []
    for mode, r in result["modes"].items():
        best = next((x for x in r["rates"] if x["rate"] == r["max_rate"]), None)
        g = r.get("goodput_vs_naive")
        rows.append(
            [
                mode,
                r["max_rate"] if r.get("broke_sla", True) else f"{r['max_rate']} (did not break)",
                round(r.get("goodput_at_max", 0.0), 3),
                f"x{g:.2f}" if g else "-",
                round(r["throughput_at_max"], 3),
                round(best["p90_ttft"], 2) if best else "-",
                round(1000 * best["p90_tpot"]) if best else "-",
            ]
        )
    ratio = result["ratio_vs_naive"]
    s = result["sla"]
    out = []
    if result.get("workload") == "retrieval":
        m = result["modes"]
        crow = []
        for mode, r in m.items():
            cg = r.get("correct_goodput_at_max", 0.0)
            vs = {o: cg / m[o]["correct_goodput_at_max"] if m[o].get("correct_goodput_at_max") else None
                  for o in ("naive", "off")}  # fmt: skip
            acc = [f"{x['correct']}/{result['requests_per_rate']}" for x in r["rates"]]
            crow.append([mode, r["max_rate"], round(cg, 3), *(f"x{v:.2f}" if v else "-" for v in vs.values()),
                         round(r.get("best_correct_goodput", 0.0), 3), " ".join(acc)])  # fmt: skip
        out.append(
            Table(
                "Served-correct goodput: requests per second that met the SLA and retrieved their needle "
                f"({result['evict']} eviction, parking tier {result['park_tokens']} tokens"
                + (f", pressure floor {result['pressure_floor']:g}" if result.get("pressure_floor") else "")
                + ")",
                [
                    "mode",
                    "max rate within SLA",
                    "served-correct goodput there",
                    "vs naive",
                    "vs off",
                    "best over rates",
                    "needles retrieved per rate",
                ],  # fmt: skip
                crow,
            )
        )
    return out + [
        Table(
            f"Highest Poisson arrival rate within the SLA ({result['model']}, {result['policy']} at budget "
            f"{result['budget']}, {result['pool_blocks']}-block pool, {result['prompt_tokens']}-token prompts "
            f"read in chunks of {result.get('prefill_chunk')}, {result['max_tokens']} output tokens, "
            f"{result['requests_per_rate']} requests per rate)",
            [
                "mode",
                "max rate within SLA (req/s)",
                "goodput there (req/s)",
                "goodput vs naive",
                "completed req/s there",
                "p90 TTFT (s)",
                "p90 TPOT (ms)",
            ],
            rows,
            f"SLA: p90 TTFT <= {s['ttft']:.2f} s and p90 TPOT <= {1000 * s['tpot']:.0f} ms. Goodput: requests per "
            "second that met the SLA individually. Max rate vtoken / naive: "
            + (f"x{ratio:.2f}" if ratio else "n/a")
            + " (paper: up to 1.37x SLA throughput).",
        )
    ]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    for mode, r in result["modes"].items():
        rates = [x["rate"] for x in r["rates"]]
        ax1.plot(rates, [x["p90_ttft"] for x in r["rates"]], "o-", label=mode)
        ax2.plot(rates, [1000 * x["p90_tpot"] for x in r["rates"]], "o-", label=mode)
    ax1.axhline(result["sla"]["ttft"], color="k", ls="--", label="SLA")
    ax2.axhline(1000 * result["sla"]["tpot"], color="k", ls="--", label="SLA")
    ax1.set(xlabel="arrival rate (req/s)", ylabel="p90 TTFT (s)", yscale="log")
    ax2.set(xlabel="arrival rate (req/s)", ylabel="p90 TPOT (ms)")
    ax1.legend()
    ax2.legend()
