"""The frontier: requests per second against answers kept, stock vLLM (fp32 and fp8 KV) and vToken, one KV pool.

Every configuration gets a KV pool of the same BYTES (``--kv-bytes``; an fp8 cache holds more tokens in it):

  stock              vToken off, kv_cache_dtype auto (the model's dtype)
  stock-fp8          vToken off, kv_cache_dtype fp8
  vtoken-0.5         vToken (snapkv, pressure mode, the parking tier, recall every ``--recall-every`` decode
                     steps: the served defaults of 12-06) at budget 0.5
  vtoken-0.25        the same at 0.25
  vtoken-0.25-floor  the same at 0.25 with ``pressure_floor`` ``--floor``: admission keeps that share of every
                     running request's tokens, so requests wait instead of shedding below it
  vtoken-0.5-norecall  vtoken-0.5 without recall (``recall_every`` 0): what recall buys (the others recall every
                     ``--recall-every`` decode steps), for its default
  vtoken-fp8-0.5     vToken on an fp8 cache at 0.5, and at 0.25 (``vtoken-fp8-0.25``)

For each configuration, two measurements with the same engine settings:

  throughput  stock vLLM's OpenAI server (vToken switched in by its flags, ``serve_args``: one server for every
              configuration) measured by vLLM's own client (vtoken/bench/serve.py ``client``): random prompts,
              ``--ignore-eos``, every request sent at once (``--rate inf``) so that the pool saturates; a
              decode-heavy workload (short prompts, long replies: the pool fills while decoding) and a
              prefill-heavy one (long prompts, short replies)
  answers     the suites of vtoken/bench/suites.py, each served all at once into the same pool (offline engine,
              the same engine arguments), scored by the suite's own metric: the needle's value for niah and
              multi, content-word F1 >= 0.5 with STOCK fp32's reply to the same prompt for agree and longreply
              (stock fp32 is always served for that reference). An answer is "kept" when it counts.

Answers kept, pooled: the hits over every prompt of the HELD-OUT suites (multi, agree, longreply; ``niah`` is the
tuning suite and is reported beside them, not pooled), with its 95% Wilson interval. Served-correct goodput: the
decode-heavy workload's requests per second x the pooled share of answers kept (its interval: the same
requests per second x the share's interval; the throughput's own spread is not in it).

The defaults (``choice``): the vToken configurations on the model's own KV dtype, ranked by served-correct goodput
on the TUNING suite (decode-heavy req/s x niah's share); the best one's budget, floor and recall are the shipped
defaults (vtoken/config.py SHIPPED_BUDGET, VTokenConfig), and the held-out suites say what that choice costs.

A configuration that fails to start (a KV dtype vToken refuses, vtoken/vllm_adapter/engine.py REFUSED; a server that
exits) is recorded with its error in the JSON and a table of its own, and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from vtoken.bench.engine_run import Engine, log
from vtoken.bench.needles import wilson
from vtoken.bench.report import Table, _command
from vtoken.bench.suites import SUITES, reply


class Config(NamedTuple):
    name: str
    kv_cache_dtype: str  # vLLM's: auto (the model's dtype) or fp8
    budget: float | None  # None: vToken off
    floor: bool = False  # pressure_floor at --floor
    recall: bool = True  # recall_every --recall-every; False: 0 (parked tokens come back only when the pool has room)

    def vtoken(self, args) -> dict[str, Any]:
        """The VTokenConfig of its engines: snapkv, pressure mode, the parking tier, recall every ``--recall-every``
        steps (the served defaults of 12-06, the run that chose today's), and the prefill chunk every configuration
        reads prompts in."""
        if self.budget is None:
            return {"mode": "off"}
        cfg = {"mode": "vtoken", "policy": args.policy, "budget": self.budget, "evict": "pressure",
               "pressure_floor": args.floor if self.floor else 0.0, "prefill_chunk": args.prefill_chunk}  # fmt: skip
        return {**cfg, "recall_every": args.recall_every if self.recall else 0}


CONFIGS = {
    c.name: c
    for c in (
        Config("stock", "auto", None),
        Config("stock-fp8", "fp8", None),
        Config("vtoken-0.5", "auto", 0.5),
        Config("vtoken-0.25", "auto", 0.25),
        Config("vtoken-0.25-floor", "auto", 0.25, floor=True),
        Config("vtoken-0.5-norecall", "auto", 0.5, recall=False),
        Config("vtoken-fp8-0.5", "fp8", 0.5),
        Config("vtoken-fp8-0.25", "fp8", 0.25),
    )
}
REFERENCE = "stock"  # agree and longreply count a reply by this configuration's reply to the same prompt
HELD_OUT = tuple(name for name, s in SUITES.items() if not s.tuning)


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--only", default="", help=f"configurations to run, comma-separated (default: {', '.join(CONFIGS)})")
    p.add_argument("--suites", default=",".join(SUITES), help="answer suites (niah is the tuning suite, not pooled)")
    p.add_argument("--prompts", type=int, default=48,
                   help="prompts per suite (48: a 95%% Wilson interval at most +-14 points)")  # fmt: skip
    p.add_argument("--lengths", default="1024,2048", help="suite prompt lengths, tokens (the same for every suite)")
    p.add_argument("--kv-bytes", type=int, default=128 << 20, help="the KV pool of every configuration, bytes")
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--floor", type=float, default=0.5, help="vtoken-0.25-floor's pressure_floor")
    p.add_argument("--recall-every", type=int, default=16, help="recall_every of every vToken configuration but "
                   "vtoken-0.5-norecall (0)")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill forward (every configuration)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--decode", default="128,384,48", help="decode-heavy workload: input,output tokens,requests")
    p.add_argument("--prefill", default="1024,16,48", help="prefill-heavy workload: input,output tokens,requests")
    p.add_argument("--rate", default="inf", help="request rate of both workloads (inf: every request at once)")
    p.add_argument("--sla", default="ttft:4000,tpot:250", help="vLLM client's --goodput SLA (recorded, not used)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--add-to", default="", metavar="JSON",
                   help="add --suites to an earlier run's frontier.json: its configurations answer them on its "
                   "settings (pool, lengths, prompts, policy, floor, recall), throughput is not run again, and the "
                   "merged page is written to --out (the addition is recorded under 'added')")  # fmt: skip


# ---------------------------------------------------------------------------------------------- arithmetic
def pooled(answers: dict[str, dict], suites: tuple[str, ...] = HELD_OUT) -> dict | None:
    """Hits over every prompt of ``suites`` that ran, with the 95% Wilson interval; None if none ran."""
    ran = [s for s in suites if "hits" in answers.get(s, {})]
    if not ran:
        return None
    hits, n = sum(answers[s]["hits"] for s in ran), sum(answers[s]["n"] for s in ran)
    lo, hi = wilson(hits, n)
    return {"hits": hits, "n": n, "share": hits / n, "ci95": [lo, hi], "suites": ran}


def goodput(rps: float | None, kept: dict | None) -> dict | None:
    """Served-correct goodput: requests per second x the share of answers kept, and the same rate x the share's
    interval."""
    if rps is None or kept is None:
        return None
    return {"value": rps * kept["share"], "ci95": [rps * kept["ci95"][0], rps * kept["ci95"][1]]}


def _score(c: dict) -> dict:
    """A configuration's pooled answers kept, served-correct goodput and errors, from its throughput and answers."""
    c["kept"] = pooled(c["answers"])
    c["goodput"] = goodput(_decode_rps(c), c["kept"])
    c["errors"] = {part: r["error"] for part, r in {**c["throughput"], **c["answers"]}.items() if "error" in r}
    return c


def ratios(configs: dict[str, dict]) -> None:
    """Each configuration's goodput over stock's and over stock fp8's (None where either is missing)."""
    for c in configs.values():
        for base in ("stock", "stock-fp8"):
            b, g = (configs.get(base) or {}).get("goodput"), c.get("goodput")
            c.setdefault("vs", {})[base] = g["value"] / b["value"] if g and b and b["value"] else None


# ---------------------------------------------------------------------------------------------- measurements
def _engine_kw(args, config: Config) -> dict[str, Any]:
    """The engine arguments both measurements share, beyond serve.py's (dtype, block size, pool, eager)."""
    return {"kv_cache_dtype": config.kv_cache_dtype, "enable_prefix_caching": False,
            "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip


def _server_flags(args, config: Config) -> list[str]:
    """vLLM server flags: the shared arguments, and vToken's (``serve_args`` refuses what vToken refuses)."""
    from vtoken.vllm_adapter.engine import serve_args

    kw = _engine_kw(args, config)
    flags = ["--kv-cache-dtype", config.kv_cache_dtype, "--no-enable-prefix-caching",
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    if config.budget is None:  # stock reads prompts in the same chunks
        return flags + ["--enable-chunked-prefill", "--long-prefill-token-threshold", str(args.prefill_chunk)]
    return flags + serve_args(config.vtoken(args), enforce_eager=True, **kw)


def _workload(spec: str) -> dict[str, int]:
    i, o, n = (int(x) for x in spec.split(","))
    return {"input_len": i, "output_len": o, "requests": n}


def throughput(args, config: Config, folder: str, workloads: dict[str, dict]) -> dict[str, dict]:
    """Each workload through vLLM's client against one server of ``config``; an error entry if it cannot run."""
    from vtoken.bench.serve import WARM_SEED, client, stock_server

    out: dict[str, dict] = {}
    try:
        flags = _server_flags(args, config)
        server = argparse.Namespace(model=args.model, max_model_len=args.max_model_len, kv_bytes=args.kv_bytes)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as deployed: the EngineCore in its own process
        with tempfile.TemporaryDirectory() as tmp, stock_server(server, folder, flags, env) as url:
            for name, w in workloads.items():
                c = argparse.Namespace(model=args.model, input_len=w["input_len"], output_len=w["output_len"],
                                       seed=args.seed, goodput=args.sla, max_concurrency=0)  # fmt: skip
                client(argparse.Namespace(**{**vars(c), "output_len": 4}), url, folder, float("inf"), tmp,
                       seed=WARM_SEED, num_prompts=2)  # warm-up on prompts no workload sends  # fmt: skip
                out[name] = r = client(c, url, folder, float(args.rate), tmp, num_prompts=w["requests"])
                log(f"[frontier] {config.name} {name}: {r['completed']} ok, {r['failed']} failed, "
                    f"{r['request_throughput']:.3f} req/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                    f"TPOT p50 {r['median_tpot_ms']:.1f} ms")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - one configuration's failure is a result, not the run's end
        for name in workloads:
            out.setdefault(name, {"error": _error(e)})
        log(f"[frontier] {config.name} throughput: ERROR {_error(e)}")
    return out


def answers(args, config: Config, folder: str, tok, cases: dict, reference: dict[str, list[str]]):
    """Every suite served all at once into the pool by an offline engine of ``config``, scored (the reference
    configuration's replies become ``reference``); and the pool's blocks (None if it did not start)."""
    out: dict[str, dict] = {}
    blocks = None
    mode = "off" if config.budget is None else "vtoken"
    cfg = {"prefill_chunk": args.prefill_chunk} if mode == "off" else config.vtoken(args)
    try:
        with Engine(folder, mode, cfg, kv_bytes=args.kv_bytes, max_model_len=args.max_model_len,
                    **_engine_kw(args, config)) as e:  # fmt: skip
            for name, cs in cases.items():
                suite = SUITES[name]
                if suite.needs_full and config.name != REFERENCE and name not in reference:
                    out[name] = {"error": f"no reference: {REFERENCE} did not answer {name}"}
                    continue
                b = e.batch([c.prompt for c in cs], suite.max_tokens)
                texts = [reply(tok, s.output_tokens, suite.chat) for s in b.served]
                if config.name == REFERENCE:
                    reference[name] = texts
                full = reference.get(name, [""] * len(cs))
                hits = [bool(suite.hit(c, t, f)) for c, t, f in zip(cs, texts, full)]
                lo, hi = wilson(sum(hits), len(hits))
                out[name] = {"hits": sum(hits), "n": len(hits), "share": sum(hits) / len(hits), "ci95": [lo, hi],
                             "per_prompt": [int(h) for h in hits], "preemptions": b.preemptions,
                             "seconds": round(b.seconds, 1), "answers": texts}  # fmt: skip
                log(f"[frontier] {config.name} {name}: {sum(hits)}/{len(hits)} kept ({b.seconds:.0f} s)")
            blocks = e.total_blocks
    except Exception as e:  # noqa: BLE001
        out = {name: {"error": _error(e)} for name in cases}
        log(f"[frontier] {config.name} answers: ERROR {_error(e)}")
    return out, blocks


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[-600:]}"


def _kv_bytes_per_token(folder: str) -> dict[str, int]:
    c = json.loads((Path(folder) / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head
    return {"auto": per * 4, "fp8": per}  # the model runs in fp32 here


def _git() -> dict[str, Any]:
    """The commit of the code that runs (this file's checkout, not the working folder's: a run from a frozen
    worktree records the worktree's), and whether its tracked files differ from it."""
    here = str(Path(__file__).resolve().parent)

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", here, *a], capture_output=True, text=True, timeout=30).stdout.strip()

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    return {}


def run(args) -> dict:
    if args.add_to:
        return add(args)
    if args.quick:  # the same shapes, shorter suite prompts, a few requests and 8 prompts per suite
        args.prompts, args.lengths, args.kv_bytes = 8, "512", 48 << 20
        args.decode, args.prefill = "128,384,4", "1024,16,4"
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    bad = sorted(set(names) - set(CONFIGS))
    if bad:
        raise SystemExit(f"--only: unknown {bad}; choose from {', '.join(CONFIGS)}")
    folder, tok = _model(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    cases = _cases(tok, [s for s in args.suites.split(",") if s], lengths, args.prompts)
    workloads = {"decode": _workload(args.decode), "prefill": _workload(args.prefill)}
    longest = max([len(c.prompt) + SUITES[s].max_tokens for s, cs in cases.items() for c in cs]
                  + [w["input_len"] + w["output_len"] for w in workloads.values()])  # fmt: skip
    args.max_model_len = -(-longest // 32) * 32
    order = _order(names, cases)
    log(f"[frontier] {', '.join(order)}: {sum(map(len, cases.values()))} prompts, pool {args.kv_bytes} bytes")
    reference: dict[str, list[str]] = {}
    configs: dict[str, dict] = {}
    for name in order:
        config = CONFIGS[name]
        ans, blocks = answers(args, config, folder, tok, cases, reference)
        if name not in names:  # served only for the reference replies
            configs[name] = {"reference_only": True, "answers": ans, "pool_blocks": blocks}
            continue
        tp = throughput(args, config, folder, workloads)
        configs[name] = _score({"settings": {**config._asdict(), "vtoken": config.vtoken(args)},
                                "pool_blocks": blocks, "throughput": tp, "answers": ans})  # fmt: skip
    ratios({k: v for k, v in configs.items() if not v.get("reference_only")})
    return {
        "model": args.model,
        "git": _git(),
        "pool_bytes": args.kv_bytes,
        "kv_bytes_per_token": _kv_bytes_per_token(folder),
        "max_model_len": args.max_model_len,
        "workloads": {k: {**w, "rate": args.rate} for k, w in workloads.items()},
        "suites": {s: _suite(s, cs, lengths) for s, cs in cases.items()},
        "reference": REFERENCE,
        "configs": configs,
        "load": {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg()[0]},
    }


def _order(names: list[str], cases: dict) -> list[str]:
    """The configurations in the order they run: the reference first, also where it was not asked for but a suite
    scores against its replies."""
    needs_ref = any(SUITES[s].needs_full for s in cases)
    return ([REFERENCE] if needs_ref or REFERENCE in names else []) + [n for n in names if n != REFERENCE]


def _model(name: str) -> tuple[str, Any]:
    """The model's folder and its tokenizer."""
    from transformers import AutoTokenizer

    from vtoken.models import model_path

    folder = str(model_path(name))
    return folder, AutoTokenizer.from_pretrained(folder)


def _cases(tok, names: list[str], lengths: list[int], prompts: int) -> dict[str, list]:
    """Each suite's prompts: ``prompts`` over ``lengths`` (niah's two tasks, single and multikey, share them)."""
    per = {name: len(lengths) * (2 if name == "niah" else 1) for name in names}
    return {name: SUITES[name].build(tok, lengths, max(prompts // per[name], 1)) for name in names}


# The earlier run's settings an added suite is answered on (everything the engines and the suites' prompts read).
SHARED = ("model", "prompts", "lengths", "kv_bytes", "policy", "floor", "prefill_chunk", "max_num_batched_tokens")


def add(args) -> dict:
    """``--add-to``: the earlier run's result with ``--suites`` answered by each of its configurations on its own
    settings (SHARED, and the recall it ran with), pooled shares, goodput and ratios computed again over every suite;
    its throughput is kept as it was measured. The addition (suites, command, commit, seconds) is under 'added'."""
    import time

    from vtoken.bench import command, machine

    t0 = time.perf_counter()
    result = json.loads(Path(args.add_to).read_text())
    new = [s for s in args.suites.split(",") if s]
    if not new or set(new) & set(result["suites"]):
        raise SystemExit(f"--add-to: name suites the run has not answered (it has {', '.join(result['suites'])})")
    earlier = result["settings"]
    for key in SHARED:
        setattr(args, key, earlier[key])
    recall = {_recall(c["settings"]) for c in result["configs"].values() if not c.get("reference_only")
              and c["settings"]["budget"] is not None and c["settings"]["recall"]}  # fmt: skip
    args.recall_every = recall.pop() if len(recall) == 1 else args.recall_every
    folder, tok = _model(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    cases = _cases(tok, new, lengths, args.prompts)
    longest = max(len(c.prompt) + SUITES[s].max_tokens for s, cs in cases.items() for c in cs)
    args.max_model_len = max(result["max_model_len"], -(-longest // 32) * 32)
    names = [n for n, c in result["configs"].items() if not c.get("reference_only")]
    for name in names:  # before any engine starts: every configuration answers on the settings it ran with
        s = result["configs"][name]["settings"]
        ran = {**s["vtoken"], **({"recall_every": _recall(s)} if s["budget"] is not None else {})}
        if ran != CONFIGS[name].vtoken(args):
            raise SystemExit(f"--add-to: {name} ran with {ran}, this run would use {CONFIGS[name].vtoken(args)}")
    order = _order(names, cases)
    log(f"[frontier] adding {', '.join(new)} to {args.add_to}: {', '.join(order)}")
    reference: dict[str, list[str]] = {}
    for name in order:
        config = CONFIGS[name]
        c = result["configs"].setdefault(name, {"reference_only": True, "answers": {}})
        ans, _ = answers(args, config, folder, tok, cases, reference)
        c["answers"].update(ans)
        if not c.get("reference_only"):
            _score(c)
    ratios({k: v for k, v in result["configs"].items() if not v.get("reference_only")})
    result["suites"].update({s: _suite(s, cs, lengths) for s, cs in cases.items()})
    result.setdefault("added", []).append({
        "suites": new, "command": command("frontier"), "git": _git(),
        "max_model_len": args.max_model_len, "recall_every": args.recall_every,
        "seconds": round(time.perf_counter() - t0, 1), "machine": machine(), "loadavg_after": os.getloadavg()[0],
    })  # fmt: skip
    return result


def _suite(name: str, cases, lengths: list[int]) -> dict[str, Any]:
    from vtoken.bench.retrieval import prompts_digest

    suite = SUITES[name]
    return {"split": "tuning" if suite.tuning else "held-out", "pooled": name in HELD_OUT, "n": len(cases),
            "lengths": lengths, "max_tokens": suite.max_tokens, "metric": suite.metric,
            "prompts_sha256": prompts_digest(cases)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- report
def _pct(r: dict | None) -> str:
    if not r:
        return "-"
    if "error" in r:
        return "error"
    return f"{r['hits']}/{r['n']} ({100 * r['share']:.0f}%, {100 * max(r['ci95'][0], 0):.0f}-{100 * r['ci95'][1]:.0f})"


def _num(r: dict, key: str, fmt: str = "{:.3f}") -> str:
    return "error" if "error" in r else ("-" if r.get(key) is None else fmt.format(r[key]))


def tables(result: dict) -> list[Table]:
    suites = list(result["suites"])
    rows, errors = [], []
    for name, c in result["configs"].items():
        if c.get("reference_only"):
            continue
        s, tp = c["settings"], c["throughput"]
        dec, pre = tp.get("decode", {}), tp.get("prefill", {})
        g, vs = c.get("goodput"), c.get("vs", {})
        rows.append([
            name, s["kv_cache_dtype"], "-" if s["budget"] is None else f"{s['budget']:g}"
            + (f", floor {s['vtoken']['pressure_floor']:g}" if s.get("floor") else ""),
            _num(dec, "request_throughput"), _num(pre, "request_throughput"),
            f"{_num(dec, 'median_ttft_ms', '{:.0f}')} / {_num(pre, 'median_ttft_ms', '{:.0f}')}",
            f"{_num(dec, 'median_tpot_ms', '{:.1f}')} / {_num(pre, 'median_tpot_ms', '{:.1f}')}",
            *[_pct(c["answers"].get(x)) for x in suites], _pct(c.get("kept")),
            f"{g['value']:.3f} ({g['ci95'][0]:.3f}-{g['ci95'][1]:.3f})" if g else "-",
            " / ".join(f"x{vs[b]:.2f}" if vs.get(b) else "-" for b in ("stock", "stock-fp8")),
            " / ".join(f"x{r:.2f}" if r else "-" for r in (_rps_ratio(result, c, b) for b in ("stock", "stock-fp8"))),
        ])  # fmt: skip
        errors += [[name, part, e] for part, e in c.get("errors", {}).items()]
    split = {s: result["suites"][s]["split"] for s in suites}
    w = result["workloads"]
    cols = ["config", "KV dtype", "budget", "req/s decode", "req/s prefill", "TTFT p50 ms (decode / prefill)",
            "TPOT p50 ms (decode / prefill)", *[f"{s} kept ({split[s]})" for s in suites],
            "pooled kept (held-out)", "served-correct goodput req/s", "goodput vs stock / vs stock fp8",
            "req/s decode vs stock / vs stock fp8"]  # fmt: skip
    per_tok = result["kv_bytes_per_token"]
    out = [
        Table(
            f"Requests per second against answers kept ({result['model']}, every configuration with a KV pool of "
            f"{result['pool_bytes'] / (1 << 20):g} MiB: {result['pool_bytes'] // per_tok['auto']} tokens at fp32, "
            f"{result['pool_bytes'] // per_tok['fp8']} at fp8)",
            cols,
            rows,
            f"Throughput: vLLM's own client against vLLM's OpenAI server (vToken switched in by its flags), "
            f"--ignore-eos, request rate {w['decode']['rate']}; decode-heavy: {w['decode']['requests']} requests of "
            f"{w['decode']['input_len']} prompt / {w['decode']['output_len']} output tokens; prefill-heavy: "
            f"{w['prefill']['requests']} of {w['prefill']['input_len']} / {w['prefill']['output_len']}. "
            "Answers: each suite served all at once into the same pool; kept = the suite's own hit (needle found "
            f"for niah and multi; content-word F1 >= 0.5 with {result['reference']}'s reply for agree and "
            "longreply), hits/n (share, 95% Wilson interval). Pooled: the held-out suites only (niah is the "
            "tuning suite). Served-correct goodput = decode-heavy req/s x pooled share kept (interval: the same "
            "req/s x the share's interval)." + _added(result),
        )
    ]
    cands, best = choice(result)
    if best:  # a run of stock and fp8 only chooses nothing
        out.append(choice_table(result, cands, best))
    if errors:
        out.append(Table("Configurations that did not run", ["config", "part", "error"], errors))
    return out


def _added(result: dict) -> str:
    """The page's word on suites a later run added (``--add-to``), or nothing."""
    return "".join(
        f" {', '.join(a['suites'])}: answered by a later run on the same settings and configurations "
        f"(`{_command(a)}`, commit {a['git'].get('commit', '?')[:7]}, {a['seconds'] / 60:.0f} min)."
        for a in result.get("added", [])
    )


def _decode_rps(c: dict) -> float | None:
    """A configuration's decode-heavy requests per second (None where it did not run)."""
    return (c.get("throughput") or {}).get("decode", {}).get("request_throughput")


def _rps_ratio(result: dict, c: dict, base: str) -> float | None:
    """A configuration's decode-heavy requests per second over ``base``'s (None where either did not run)."""
    rps, b = _decode_rps(c), _decode_rps(result["configs"].get(base) or {})
    return rps / b if rps and b else None


def _recall(settings: dict) -> int:
    """A configuration's recall_every; a run that did not record it used the default of its day, 16."""
    return settings["vtoken"].get("recall_every", 16)


def tuning_goodput(c: dict) -> dict | None:
    """Served-correct goodput on the tuning suite: decode-heavy req/s x the share of niah's needles found (and
    the same rate x the share's interval); None where either is missing."""
    niah = (c.get("answers") or {}).get("niah", {})
    return goodput(_decode_rps(c), niah if "hits" in niah else None)


def choice(result: dict) -> tuple[list[str], str | None]:
    """The defaults' candidates (vToken on the model's own KV dtype: the KV dtype is vLLM's knob, the user's),
    best served-correct goodput on the tuning suite first; and the best (None if none measured)."""
    cands = [n for n, c in result["configs"].items()
             if not c.get("reference_only") and c["settings"]["budget"] is not None
             and c["settings"]["kv_cache_dtype"] == "auto" and tuning_goodput(c)]  # fmt: skip
    cands.sort(key=lambda n: -tuning_goodput(result["configs"][n])["value"])
    return cands, (cands[0] if cands else None)


def choice_table(result: dict, cands: list[str], best: str) -> Table:
    """``choice``'s ranking as a table, ``best`` in bold."""
    rows = []
    for n in cands:
        c = result["configs"][n]
        s, g = c["settings"], tuning_goodput(c)
        recall = _recall(s)
        rows.append([("**" + n + "**") if n == best else n, f"{s['budget']:g}", f"{s['vtoken']['pressure_floor']:g}",
                     "off" if recall == 0 else f"every {recall}",
                     _num(c["throughput"].get("decode", {}), "request_throughput"), _pct(c["answers"].get("niah")),
                     f"{g['value']:.3f} ({g['ci95'][0]:.3f}-{g['ci95'][1]:.3f})", _pct(c.get("kept"))])  # fmt: skip
    return Table(
        "The defaults: served-correct goodput on the tuning suite (niah), vToken on the model's KV dtype, best first",
        [
            "config",
            "budget",
            "pressure floor",
            "recall",
            "req/s decode",
            "niah kept (tuning)",
            "tuning goodput req/s",
            "pooled kept (held-out, for its cost)",
        ],  # fmt: skip
        rows,
        f"Tuning goodput = decode-heavy req/s x the share of niah's needles found (interval: the same req/s x the "
        f"share's interval). The best, in bold: {best}. The held-out suites are not used to "
        "choose; they say what the choice costs.",
    )


def plot(result: dict, fig) -> None:
    ax = fig.subplots(1, 1)
    for i, (name, c) in enumerate(result["configs"].items()):
        kept, rps = c.get("kept"), _decode_rps(c)
        if c.get("reference_only") or not kept or rps is None:
            continue
        x, lo, hi = (100 * v for v in (kept["share"], *kept["ci95"]))
        ax.errorbar([x], [rps], xerr=[[x - lo], [hi - x]], fmt="o" if "fp8" not in name else "s", c=f"C{i}", capsize=3)
        ax.annotate(name, (x, rps), textcoords="offset points", xytext=(5, 5), fontsize=8)
    mib = result["pool_bytes"] / (1 << 20)
    if not ax.lines:  # a throughput-only run: its requests per second, one bar per configuration
        ran = {n: _decode_rps(c) for n, c in result["configs"].items() if not c.get("reference_only")}
        ran = {n: r for n, r in ran.items() if r}
        ax.bar(list(ran), list(ran.values()), color=[f"C{i}" for i in range(len(ran))])
        ax.set(ylabel="requests/s, decode-heavy", title=f"{result['model']}, a KV pool of {mib:g} MiB for every "
               f"configuration, {result['workloads']['decode']['requests']} requests at once")  # fmt: skip
        ax.grid(alpha=0.3, axis="y")
        return
    ax.set(xlabel="answers kept, pooled over held-out suites (%, 95% CI)", ylabel="requests/s, decode-heavy",
           title=f"{result['model']}, a KV pool of {mib:g} MiB for every configuration")  # fmt: skip
    ax.grid(alpha=0.3)


def _later(result: dict) -> str:
    suites = [s for a in result.get("added", []) for s in a["suites"]]
    return f" ({', '.join(suites)} answered by a second on its settings)" if suites else ""


def trade(result: dict, link: str) -> str:
    """The trade in a few lines (the README's first screen, docs/concepts.md): each configuration's requests per
    second against stock's and its answers kept; ``link``: the frontier page's path from where it is shown."""
    _, best = choice(result)
    n = max((suite["n"] for suite in result["suites"].values()), default=0)
    stock = _decode_rps(result["configs"].get("stock") or {})
    rows = []
    for name, c in result["configs"].items():
        if c.get("reference_only"):
            continue
        s = c["settings"]
        rps = _decode_rps(c)
        parts = ["stock"]
        if s["budget"] is not None:
            recall = _recall(s)
            parts = [f"vToken, budget {s['budget']:g}"]
            parts += [f"floor {s['vtoken']['pressure_floor']:g}"] if s.get("floor") else []
            parts += ["no recall" if recall == 0 else f"recall every {recall}"]
        parts += ["fp8 KV"] if s["kv_cache_dtype"] != "auto" else []
        lever = ", ".join(parts) + (" (**its budget and floor are shipped**)" if name == best else "")
        rows.append(
            f"| {lever} | {f'x{rps / stock:.2f}' if rps and stock else '-'} | "
            f"{_pct(c.get('kept'))} | {_pct((c.get('answers') or {}).get('niah'))} |"
        )
    mib = result["pool_bytes"] / (1 << 20)
    return "\n".join([
        f"[Frontier]({link}): {result['model']}, one KV pool of {mib:g} MiB for every configuration, "
        f"{result['machine']['cpus']} CPUs, one run{_later(result)}, {n} prompts a suite. Requests per second "
        "when decoding fills the pool (vLLM's own client), against stock's; answers kept with their 95% intervals, "
        "on suites never tuned on (pooled) and on the tuning suite (needles), where the best served-correct "
        "goodput chose the shipped default.",
        "",
        "| configuration | requests/s vs stock | held-out answers kept | needles (tuning suite) |",
        "| --- | --- | --- | --- |",
        *rows,
    ])  # fmt: skip
