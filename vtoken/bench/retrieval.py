"""Retrieval under eviction: a suite of prompts served through vLLM, full KV against every policy, budget and
eviction mode, with accuracy next to the blocks each costs.

Suites (``--suite``, vtoken/bench/suites.py): ``niah`` (the default), the RULER-style needle suite that every
parameter is tuned on (vtoken/bench/needles.py); ``multi``, a second needle format held out of tuning (look-alike
keys, the question before and after the text, the chat template; vtoken/bench/multi.py); ``agree``, questions
over a document scored by agreement with full KV's own replies, held out too (vtoken/bench/agree.py).

Modes (what a user sets; per request where it can be):

  decode    ``prefill_evict=False``: the prompt is read whole, eviction starts once it is read
  always    ``evict="always"``: the policy evicts at every prefill chunk boundary (bounded peak), what a
            boundary drops is lost
  park      the same, with the parking tier (``park_tokens``): what a boundary drops waits outside the pool and
            the survivors are chosen with the question in view (attention policies only)
  pressure  ``evict="pressure"`` (with the tier): nothing is evicted while the pool holds what runs and waits

Accuracy: the suite's hits over every prompt (for the needle suites, the value among the first numbers the model
writes), with its 95% Wilson interval. Blocks per request: the mean over decode steps and the peak over every
forward (prefill chunks included) of what the request held, and the same for Naive-Evict (the paired baseline
makes the same decisions, so its blocks come from the same run's accounting), and ``over bound`` (at most 0:
every forward within ``ceil((keep + chunk) / block_size) + 1`` blocks). ``--saturate`` also serves the suite at
once into a pool that cannot hold it, where pressure mode has to evict as much as ``always``.
"""

from __future__ import annotations

import json

import numpy as np

from vtoken.bench import longreply
from vtoken.bench.agree import agreement, bare_prompt, question
from vtoken.bench.engine_run import Engine, log
from vtoken.bench.needles import wilson
from vtoken.bench.report import Table
from vtoken.bench.suites import SUITES, Suite, reply

POLICIES = ("h2o", "scissorhands", "snapkv", "random", "streaming")
ATTENTION = ("h2o", "scissorhands", "snapkv")
MODES = ("decode", "always", "park", "pressure")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default="niah", choices=list(SUITES),
                   help="niah: the tuning suite; multi, agree: held out of tuning")  # fmt: skip
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--budgets", default="0.5,0.25,0.125")
    p.add_argument("--modes", default="decode,always,park", help=f"any of {', '.join(MODES)}")
    p.add_argument("--lengths", default=None, help="prompt lengths, tokens (niah: 1024,2048,4096; else 1024,2048)")
    depths = "depths per task and length (niah: 12 over 5%%..95%%; multi, agree: 20 over 10%%..90%%)"
    p.add_argument("--depths", type=int, default=None, help=depths)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--window", type=int, default=32, help="queries of a chunk's observation window")
    p.add_argument("--park-tokens", type=int, default=1 << 17, help="the parking tier's size, tokens")
    p.add_argument("--kv-bytes", type=int, default=1 << 30, help="the KV pool (a pool that never runs short)")
    p.add_argument("--saturate", default="", help="policy@budget:mode,... also served into a small pool at once")
    p.add_argument("--saturate-kv-bytes", type=int, default=96 << 20)
    p.add_argument("--pressure-floor", type=float, default=0.0,
                   help="pressure_floor of the engines (pressure mode: a request waits rather than push those running "
                   "below this share of their tokens)")  # fmt: skip
    p.add_argument("--request-floor", type=float, default=0.0,
                   help="saturated pressure runs: every other prompt asks this pressure_floor for itself "
                   "(request_args), the rest keep the engine's; each half is also scored on its own")  # fmt: skip
    p.add_argument(
        "--recall-every",
        type=int,
        default=None,
        help="decode steps between a decoding request's recalls (0: none; default: VTokenConfig's)",
    )
    p.add_argument(
        "--recall-exact",
        action="store_true",
        help="recall scores every parked token exactly (default: page boxes first, then the best pages)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per reply (niah 12, multi 16, agree 32, longreply 256)"
    )
    controls = "agree: also the question without its document, and full KV in bf16, scored the same way"
    p.add_argument("--controls", action="store_true", help=controls)
    p.add_argument("--no-full", action="store_true", help="skip the full-KV run (when merging with a run that has it)")
    p.add_argument("--reference", default="", help="agree with --no-full: full KV's replies from this retrieval.json")
    p.add_argument("--merge", default="", help="retrieval.json files of earlier runs to combine (no engine runs)")


def label(policy: str, budget: float, mode: str) -> str:
    return f"{policy}@{budget:g}:{mode}"


def options(policy: str, budget: float, mode: str, window: int, floor: float | None = None) -> dict:
    """One request's own options; ``floor``: its own pressure_floor (pressure mode only; None: the engine's)."""
    out = {
        "policy": policy,
        "budget": budget,
        "prefill_evict": mode != "decode",
        "prefill_window": window,
        "evict": "pressure" if mode == "pressure" else "always",
    }
    if floor is not None and mode == "pressure":
        out["pressure_floor"] = floor
    return out


def _engine_cfg(args, park: bool) -> dict:
    cfg = {"policy": "h2o", "collect_scores": True, "prefill_chunk": args.prefill_chunk,
           "pressure_floor": args.pressure_floor}  # fmt: skip
    if getattr(args, "recall_every", None) is not None:
        cfg["recall_every"] = args.recall_every
    if getattr(args, "recall_exact", False):
        cfg["recall_exact"] = True
    return {**cfg, "park_tokens": args.park_tokens if park else 0}


def _by_tier(configs: list[tuple[str, float, str]]):
    """(park, configurations): those without the tier, then those with it (park and pressure), one engine each.
    The compactor parks whenever a tier exists, so a mode without one must not share its engine."""
    for park in (False, True):
        mine = [c for c in configs if (c[2] in ("park", "pressure")) == park]
        if mine:
            yield park, mine


def _serve(e: Engine, cases, configs: list[tuple[str, float, str]], args, floors=None) -> dict[str, dict]:
    """Every configuration's requests in one batch (each request carries its own options; ``floors[i]``: case i's
    own pressure_floor, or None)."""
    reqs = [(c, i) for c in configs for i in range(len(cases))]
    opts = [options(*c, args.window, floors[i] if floors else None) for c, i in reqs]
    b = e.batch([cases[i].prompt for _, i in reqs], args.max_tokens, opts)
    first_done = min(s.last_token_ts for s in b.served)
    out: dict[str, dict] = {}
    for (c, i), s in zip(reqs, b.served):
        r = out.setdefault(label(*c), {"texts": [None] * len(cases), "records": [None] * len(cases), "preempted": 0,
                                       "queued": 0})  # fmt: skip
        r["texts"][i] = reply(e.tok, s.output_tokens, SUITES[args.suite].chat)
        r["records"][i] = s.record
        r["preempted"] += s.preemptions
        r["queued"] += s.scheduled_ts > first_done  # first scheduled after another request had finished: it waited
    most = _most_in_flight([(s.scheduled_ts, s.last_token_ts) for s in b.served])
    for r in out.values():
        r["most_in_flight"] = most
        r["engine"] = {"seconds": b.seconds, "decoded_tokens": b.output_tokens, **b.engine}
    return out


def _most_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most requests between their first scheduling and their last token at one moment (the batch's, all
    configurations together): with a pool that saturates it stays well under the number of requests."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def _score(cases, texts: list[str], records: list[dict] | None = None, suite: Suite = SUITES["niah"],
           full: list[str] | None = None) -> dict:  # fmt: skip
    """Hits against the suite's metric; ``full``: full KV's replies to the same prompts (``agree`` needs them)."""
    full = full or [""] * len(cases)
    hits = [suite.hit(c, t, f) for c, t, f in zip(cases, texts, full)]
    lo, hi = wilson(sum(hits), len(hits))
    by = {}
    for c, h in zip(cases, hits):
        by.setdefault(f"{c.task}@{c.length}", []).append(h)
    out = {"hits": int(sum(hits)), "n": len(hits), "accuracy": sum(hits) / len(hits), "ci95": [lo, hi],
           "by_task": {k: f"{sum(v)}/{len(v)}" for k, v in by.items()}, "answers": texts}  # fmt: skip
    if suite.needs_full:
        ask = longreply.question if suite.name == "longreply" else question
        f1 = np.array([agreement(t, f, ask(c)) for c, t, f in zip(cases, texts, full)])
        half = 1.96 * f1.std(ddof=1) / np.sqrt(len(f1)) if len(f1) > 1 else 0.0
        out["agreement"] = {"mean": float(f1.mean()), "ci95": [float(f1.mean() - half), float(f1.mean() + half)],
                            "per_prompt": f1.round(3).tolist()}  # fmt: skip
        if suite.name == "longreply":
            parted = [longreply.parted_at(t, f) for t, f in zip(texts, full)]
            out["parted_at"] = {"median": float(np.median(parted)), "per_prompt": parted}
    if records and all(records):

        def mean(key: str) -> float:
            return float(np.mean([r[key] for r in records]))

        out["blocks"] = {
            "mean": mean("mean_retained_blocks"),
            "peak": mean("peak_retained_blocks"),
            "naive_mean": mean("mean_naive_retained_blocks"),
            "naive_peak": mean("peak_naive_retained_blocks"),
            "max_over_bound": int(max(r["peak_over_bound"] for r in records)),
        }
    return out


def merge(paths: list[str]) -> dict:
    """Runs of the same suite, split to keep each engine run short, as one result (later runs win)."""
    runs = [json.loads(open(p).read()) for p in paths]
    out = {k: v for k, v in runs[0].items() if k not in ("benchmark", "command", "settings", "machine", "seconds")}
    out["configs"], out["saturated"], out["merged_from"] = {}, {}, [r["command"] for r in runs]
    for r in runs:
        if r["prompts"] != out["prompts"] or r["lengths"] != out["lengths"] or _suite(r) != _suite(out):
            raise SystemExit(f"--merge: {r['command']} ran another suite")
        full = r["configs"].get("full KV", {}).get("answers")
        if full and out["configs"].get("full KV", {}).get("answers", full) != full:  # agree is scored against it
            raise SystemExit(f"--merge: {r['command']} has other full-KV replies (another machine or model?)")
        out["configs"].update(r["configs"])
        out["saturated"].update(r.get("saturated", {}))
        out.setdefault("controls", {}).update(r.get("controls", {}))
    if "full KV" not in out["configs"]:
        raise SystemExit("--merge: no run has the full-KV baseline")
    out["configs"] = {"full KV": out["configs"].pop("full KV"), **out["configs"]}
    out["budgets"] = sorted({b for r in runs for b in r["budgets"]}, reverse=True)
    return out


def _suite(result: dict) -> str:
    return result.get("suite", {}).get("name", "niah")  # runs from before --suite were the needle suite


def run(args) -> dict:
    from transformers import AutoTokenizer

    from vtoken.models import model_path

    if args.merge:
        return merge(args.merge.split(","))
    suite = SUITES[args.suite]
    args.lengths = args.lengths or suite.lengths
    args.depths = args.depths or suite.depths
    args.max_tokens = args.max_tokens or suite.max_tokens
    if args.quick:
        args.model, args.policies, args.budgets = "tiny-llama", "snapkv,random", "0.25"
        args.lengths, args.depths = ("256", 2) if suite.name == "niah" else ("384", 3)
        args.modes, args.prefill_chunk, args.window, args.max_tokens = "always,park,pressure", 64, 8, 4
        args.park_tokens, args.saturate, args.saturate_kv_bytes = 4096, "snapkv@0.25:pressure", 1 << 20
    if suite.needs_full and args.no_full and not args.reference:
        raise SystemExit(f"--suite {suite.name} scores every reply against full KV's: --no-full needs --reference")
    folder = str(model_path(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    cases = suite.build(tok, [int(n) for n in args.lengths.split(",")], args.depths)
    full = _reference(args.reference, cases) if args.no_full and args.reference else None
    policies, modes = args.policies.split(","), [m for m in args.modes.split(",") if m]  # "": saturation only
    bad = sorted(set(modes) - set(MODES)) + sorted(set(policies) - set(POLICIES))
    if bad:
        raise SystemExit(f"unknown modes or policies: {bad}")
    budgets = [float(b) for b in args.budgets.split(",")]
    configs = [(p, b, m) for p in policies for b in budgets for m in modes if m == "decode" or m == "always"
               or p in ATTENTION]  # fmt: skip
    longest = max(len(c.prompt) for c in cases) + args.max_tokens
    kw = dict(kv_bytes=args.kv_bytes, max_model_len=longest, enable_prefix_caching=False,
              max_num_batched_tokens=args.prefill_chunk)  # fmt: skip
    log(f"[retrieval] {suite.name} ({suite.role}): {len(cases)} prompts x {1 + len(configs)} configurations")
    result: dict = {"model": args.model, "prompts": len(cases), "configs": {}, "controls": {}}
    if not args.no_full:
        with Engine(folder, "off", {"prefill_chunk": args.prefill_chunk}, **kw) as e:
            b = e.batch([c.prompt for c in cases], args.max_tokens)
            full = [reply(tok, s.output_tokens, suite.chat) for s in b.served]
            result["configs"]["full KV"] = _score(cases, full, None, suite, full)
            if args.controls and suite.needs_full:
                b = e.batch([bare_prompt(tok, c) for c in cases], args.max_tokens)
                texts = [reply(tok, s.output_tokens, suite.chat) for s in b.served]
                result["controls"]["no document"] = _score(cases, texts, None, suite, full)
        log(f"[retrieval] full KV: {result['configs']['full KV']['hits']}/{len(cases)}")
        if args.controls and suite.needs_full:
            with Engine(folder, "off", {"prefill_chunk": args.prefill_chunk}, dtype="bfloat16", **kw) as e:
                b = e.batch([c.prompt for c in cases], args.max_tokens)
                texts = [reply(tok, s.output_tokens, suite.chat) for s in b.served]
                result["controls"]["full KV in bf16"] = _score(cases, texts, None, suite, full)
            log(f"[retrieval] controls: { {k: v['hits'] for k, v in result['controls'].items()} }")
    for park, mine in _by_tier(configs):
        with Engine(folder, "vtoken", _engine_cfg(args, park), **kw) as e:
            e.tok = tok
            for name, r in _serve(e, cases, mine, args).items():
                result["configs"][name] = _score(cases, r["texts"], r["records"], suite, full)
                log(f"[retrieval] {name}: {result['configs'][name]['hits']}/{len(cases)}")
    result["saturated"] = _saturated(args, folder, tok, cases, kw, full) if args.saturate else {}
    result.update(settings(args, cases))
    return result


def prompts_digest(cases) -> str:
    import hashlib

    return hashlib.sha256(json.dumps([c.prompt for c in cases]).encode()).hexdigest()[:16]


def _reference(path: str, cases) -> list[str]:
    """Full KV's replies from an earlier run of the same prompts (a run split in two need not serve it twice)."""
    ref = json.loads(open(path).read())
    digest = ref.get("prompts_sha256")
    if digest != prompts_digest(cases) or "full KV" not in ref.get("configs", {}):
        raise SystemExit(f"--reference {path}: not a run of these prompts with full KV (prompts {digest})")
    return ref["configs"]["full KV"]["answers"]


def _saturated(args, folder, tok, cases, kw, full: list[str] | None = None) -> dict:
    """The listed configurations with the whole suite arriving at once into a small pool: pressure mode has to
    evict as much as always there, and the peak bound has to hold."""
    configs = []
    for item in args.saturate.split(","):
        pb, mode = item.split(":")
        policy, budget = pb.split("@")
        configs.append((policy, float(budget), mode))
    out = {}
    sat = {**kw, "kv_bytes": args.saturate_kv_bytes}
    for park, mine in _by_tier(configs):
        with Engine(folder, "vtoken", _engine_cfg(args, park), **sat) as e:
            e.tok = tok
            for c in mine:
                ask = getattr(args, "request_floor", 0.0) if c[2] == "pressure" else 0.0
                floors = [ask if i % 2 == 0 else None for i in range(len(cases))] if ask else None
                r = _serve(e, cases, [c], args, floors)[label(*c)]
                out[label(*c)] = _score(cases, r["texts"], r["records"], SUITES[args.suite], full)
                out[label(*c)]["preemptions"] = r["preempted"]
                out[label(*c)]["queued"] = r["queued"]
                out[label(*c)]["most_in_flight"] = r["most_in_flight"]
                out[label(*c)]["recall"] = recall_figures(r["engine"])
                if floors:  # the same run, each half on its own: the prompts that asked a floor, and the rest
                    for name, half in (
                        (f"{label(*c)}, asks {ask:g}", slice(0, None, 2)),
                        (f"{label(*c)}, the rest", slice(1, None, 2)),
                    ):
                        out[name] = _score(cases[half], r["texts"][half], r["records"][half], SUITES[args.suite],
                                           full[half] if full else None)  # fmt: skip
                        out[name].update(preemptions="-", queued="-", most_in_flight="-")
                        log(f"[retrieval] saturated {name}: {out[name]['hits']}/{out[name]['n']}")
                log(f"[retrieval] saturated {label(*c)}: {out[label(*c)]['hits']}/{len(cases)}")
    return {k: out[k] for c in configs for k in out if k == label(*c) or k.startswith(f"{label(*c)}, ")}


def recall_figures(engine: dict) -> dict:
    """What recall did in a run (the engine's counters for its batch): recalls, tokens recalled and brought back
    when the pool had room again, parked bytes read to score recalls (per decoded token), and the host time
    scoring them as a share of the run's time."""
    decoded = max(engine.get("decoded_tokens", 0), 1)
    seconds = engine.get("seconds", 0.0)
    return {
        "recalls": engine.get("recalls", 0),
        "tokens_recalled": engine.get("tokens_recalled", 0),
        "tokens_reinflated": engine.get("tokens_reinflated", 0),
        "tokens_parked": engine.get("tokens_parked", 0),
        "tokens_dropped_full": engine.get("tokens_dropped_full", 0),
        "recall_bytes_per_decoded_token": engine.get("recall_bytes", 0) / decoded,
        "recall_seconds": engine.get("recall_seconds", 0.0),
        "recall_share_of_run": engine.get("recall_seconds", 0.0) / seconds if seconds else 0.0,
        "run_seconds": seconds,
        "decoded_tokens": engine.get("decoded_tokens", 0),
    }


def settings(args, cases) -> dict:
    from vtoken.bench import idle_text

    suite = SUITES[args.suite]
    text = {"multi": idle_text.manual, "agree": idle_text.release_notes}.get(suite.name)
    return {
        "suite": {
            "name": suite.name,
            "tuning": suite.tuning,
            "role": suite.role,
            "text": suite.text,
            "metric": suite.metric,
            **({"text_sha256": idle_text.digest(text())} if text else {}),
        },
        "prompts_sha256": prompts_digest(cases),
        "lengths": sorted({c.length for c in cases}),
        "tasks": sorted({c.task for c in cases}),
        "prefill_chunk": args.prefill_chunk,
        "window": args.window,
        "park_tokens": args.park_tokens,
        "pressure_floor": args.pressure_floor,
        "request_floor": getattr(args, "request_floor", 0.0),
        "budgets": [float(b) for b in args.budgets.split(",")],
        "max_tokens": args.max_tokens,
        "recall_every": getattr(args, "recall_every", None),
        "recall_exact": getattr(args, "recall_exact", False),
    }


# ---------------------------------------------------------------------------------------------- report
def _acc(r: dict) -> str:
    lo, hi = max(r["ci95"][0], 0.0), r["ci95"][1]  # Wilson's lower bound at 0 hits can round to -0
    return f"{r['hits']}/{r['n']} ({100 * r['accuracy']:.0f}%, {100 * lo:.0f}-{100 * hi:.0f})"


def _title(result: dict) -> str:
    """Which suite, and whether it is the one the parameters were tuned on."""
    sw = result.get("suite", {"name": "niah", "role": "tuning suite"})
    what = {
        "niah": f"{', '.join(result['tasks'])}, needles at 5-95% depth",
        "multi": "3 look-alike keys, question before and after the text, chat template, needles at 10-90% depth",
        "agree": "questions over release notes at 10-90% depth, a hit = content-word F1 >= 0.5 with full KV's reply",
        "longreply": "256-token retellings of release notes from an entry at 10-90% depth, a hit = content-word F1 "
        ">= 0.5 with full KV's reply",
    }[sw["name"]]
    return (f"Suite {sw['name']}, {sw['role']} ({result['model']}, {result['prompts']} prompts at "
            f"{', '.join(map(str, result['lengths']))} tokens: {what}; prompts read in chunks of "
            f"{result['prefill_chunk']})")  # fmt: skip


def _f1(r: dict) -> str:
    a = r.get("agreement")
    return f"{a['mean']:.2f} ({a['ci95'][0]:.2f}-{a['ci95'][1]:.2f})" if a else "-"


def tables(result: dict) -> list[Table]:
    full = result["configs"].get("full KV", {"hits": 0, "n": 0, "accuracy": 0.0, "ci95": [0.0, 0.0]})
    agree = bool(full.get("agreement"))
    rows = [["full KV (off)", "-", "-", _acc(full), "-", "-", "-", "-", "-"] + ([_f1(full)] if agree else [])]
    rows = rows if full["n"] else []  # a run without full KV (--no-full) has no row of it
    for name, r in result["configs"].items():
        if name == "full KV":
            continue
        (pb, mode), bl = name.split(":"), r.get("blocks", {})
        policy, budget = pb.split("@")
        rel = r["accuracy"] / full["accuracy"] if full["accuracy"] else float("nan")
        mean, peak, naive = (f"{bl.get(k, 0):.1f}" for k in ("mean", "peak", "naive_peak"))
        rows.append([policy, budget, mode, _acc(r), f"{100 * rel:.0f}%", mean, peak, naive, bl.get("max_over_bound")]
                    + ([_f1(r)] if agree else []))  # fmt: skip
    cols = ["policy", "budget", "mode", "hits (95% CI)", "of full KV", "blocks mean", "blocks peak", "Naive-Evict peak",
            "over bound"] + (["mean F1 with full KV (95% CI)"] if agree else [])  # fmt: skip
    out = [
        Table(
            _title(result),
            cols,
            rows,
            "Blocks per request: mean over decode steps, peak over every forward (prefill chunks included); "
            "Naive-Evict makes the same decisions (its blocks from the same run's accounting). over bound <= 0: "
            "every forward within ceil((keep + chunk) / block_size) + 1 blocks. decode: eviction once the prompt "
            "is read; always: at every chunk boundary; park: the same with the parking tier; pressure: only when "
            "the pool runs short (no bound: a request holds what the pool allows).",
        )
    ]
    saturated = "The same prompts all at once into a small pool (saturation)"
    if not rows:  # a saturation run alone (--no-full --modes=): its table is the only one, titled by the suite
        out, saturated = [], f"{_title(result)}, all at once into a small pool (saturation)"
    if result.get("controls"):
        crows = [[n, _acc(r), _f1(r)] for n, r in result["controls"].items()]
        out.append(Table("Controls of the metric, scored against full KV's replies", ["control", "hits (95% CI)",
                         "mean F1 (95% CI)"], crows))  # fmt: skip
    if result.get("saturated"):
        sat = result["saturated"].items()
        srows = []
        for n, r in sat:
            rc = r.get("recall") or {}
            srows.append([n, _acc(r), _f1(r), (r.get("parted_at") or {}).get("median", "-"),
                          f"{r['blocks']['peak']:.1f}", r["blocks"]["max_over_bound"], r["preemptions"],
                          r.get("queued", "-"), r.get("most_in_flight", "-"), rc.get("recalls", "-"),
                          rc.get("tokens_recalled", "-"), rc.get("tokens_reinflated", "-"),
                          f"{rc['recall_bytes_per_decoded_token']:.0f}" if rc else "-",
                          f"{100 * rc['recall_share_of_run']:.1f}%" if rc else "-"])  # fmt: skip
        cols = ["configuration", "hits (95% CI)", "mean F1 with full KV", "parted at (words, median)", "blocks peak",
                "over bound", "preemptions", "queued", "most at once", "recalls", "tokens recalled",
                "tokens back when room", "recall bytes / decoded token", "recall's share of the run"]  # fmt: skip
        out.append(Table(saturated, cols, srows,
                         "over bound: blocks over ceil((keep + chunk) / block_size) + 1 at the worst forward; under "
                         "evict: pressure the budget is a floor, not a bound, so more than 0 is expected. "
                         "queued: requests first scheduled after another request had finished; most at once: the "
                         "most requests between first scheduling and last token at one moment; recalls: choices among "
                         "live and parked tokens while decoding; tokens back when room: parked tokens returned "
                         "once the pool had room and nothing waited; recall bytes: parked keys and page boxes read "
                         "to score recalls; recall's share: the host time scoring them over the run's time "
                         "(prefill included)."))  # fmt: skip
    return out


def plot(result: dict, fig) -> None:
    ax = fig.subplots(1, 1)
    full = result["configs"].get("full KV", {}).get("accuracy", 0.0)
    marks = {"decode": "s", "always": "o", "park": "^", "pressure": "D"}
    for i, p in enumerate(POLICIES):
        for name, r in result["configs"].items():
            if name.startswith(p + "@") and "blocks" in r:
                mode = name.split(":")[1]
                ax.scatter(r["blocks"]["peak"], 100 * r["accuracy"], c=f"C{i}", marker=marks[mode], s=36,
                           label=f"{p} ({mode})")  # fmt: skip
    ax.axhline(100 * full, color="k", ls=":", label="full KV")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=6, ncol=2)
    name = result.get("suite", {}).get("name", "niah")
    ax.set(xlabel="peak blocks per request", ylabel="hits (%)",
           title=f"suite {name}: accuracy against memory, the Pareto front")  # fmt: skip
