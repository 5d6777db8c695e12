"""Multi-turn chat through the OpenAI door: prefix-aware placement, vToken's defaults against stock vLLM, a short pool.

Conversations over a few shared system prompts (``--system-chars`` each, cut from real text on the machine), of
``--turns`` turns whose user messages arrive over time (an exponential think time between a reply and the next
message). Each turn is a streaming ``/v1/chat/completions`` request carrying the whole conversation so far, against
`vtoken serve` started in this process (cluster/server.py BackgroundServer, an embedded Ray); TTFT is measured at the
client (request sent to the first content), the prefix hit rate from the replicas' ``vllm:prefix_cache_hits`` and
``vllm:prefix_cache_queries`` counters in ``/metrics`` before and after. Three parts:

1. placement: two replicas with vToken's defaults, ``--strategies`` switched live (Controller.set_placement), each
   on conversations of its own (the same shapes, other text: no strategy reads what another left in a cache);
2. one replica, vToken's defaults against stock vLLM (vToken mode off), on the same conversations: TTFT of every
   turn after the first (the turns a prefix cache can serve), hit rates, and whether the replies agree;
3. one replica with vToken's defaults and a pool too short for the conversations (``--short-kv-bytes``), so eviction
   runs: its hit rate and tokens evicted, and its replies against the full-KV replies of part 2's stock run, each
   turn sent with the full-KV run's history (so one differing reply does not change every later prompt).

``--parts`` runs some of them (part 3 compares with part 2's stock replies). Where placement has something to
win: with the defaults every replica soon caches all 3 system prompts, so any placement reads them from a cache;
docs/results/chat_long.md and chat_long_reversed.md run part 1 on SmolLM2 with more system prompt than one
replica's pool holds and long user messages, where a turn that lands away from its history prefills it again.

A measurement, not a test: on CPUs the replicas share the machine with whatever else runs, so the result states the
load (``os.getloadavg()`` before and after). ``--engine fake`` runs the same path on the fake engine (structure only).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.report import Table

KV_BYTES = 64 << 20  # 1024 blocks of tiny-llama: every conversation of a run stays cached
SHORT_KV_BYTES = 6 << 20  # 96 blocks (3,072 tokens): two conversations' contexts do not fit at once
MAX_MODEL_LEN = 2048  # a conversation's 8 turns fit; vLLM needs a pool that holds one such request
PARTS = ("placement", "single", "short")
QUICK = {"conversations": 4, "turns": "3,4", "max_tokens": 16, "think_s": 0.2, "gap_s": 0.2}


def add_args(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm", help="fake: structure only, seconds")
    p.add_argument("--conversations", type=int, default=16, help="conversations per run")
    p.add_argument("--turns", default="4,8", help="turns per conversation, the least and the most")
    p.add_argument("--system-prompts", type=int, default=3, help="shared system prompts")
    p.add_argument("--system-chars", type=int, default=3600, help="characters of each system prompt")
    p.add_argument("--user-words", type=int, default=40, help="words of a user message, at most (uniform from 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens of every reply (ignore_eos: exactly)")
    p.add_argument("--think-s", type=float, default=2.0, help="mean seconds between a reply and the next message")
    p.add_argument("--gap-s", type=float, default=0.5, help="seconds between two conversations' starts")
    p.add_argument("--strategies", default="round_robin,weighted,prefix")
    p.add_argument("--kv-bytes", type=int, default=KV_BYTES, help="KV pool of each replica")
    p.add_argument("--short-kv-bytes", type=int, default=SHORT_KV_BYTES, help="the short pool of part 3")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help="every server's; a conversation must fit")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run, any of {', '.join(PARTS)}")
    p.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Conversation:
    """A system prompt, the user messages in order, and the think time before each message after the first."""

    system: str
    users: tuple[str, ...]
    think_s: tuple[float, ...]


def conversations(args, seed: int, text_seed: int | None = None) -> list[Conversation]:
    """``args.conversations`` conversations over ``args.system_prompts`` system prompts. ``seed`` draws their shapes
    (which system prompt, how many turns, each message's length, the think times), ``text_seed`` (default: ``seed``)
    where in the machine's real text each system prompt and message is cut: two text seeds give conversations of
    the same shapes that share no text."""
    from vtoken.texts import real_text

    shape, where = random.Random(seed), random.Random(seed if text_seed is None else text_seed)
    text = real_text(200_000)
    words = text.split()
    lo, hi = (int(x) for x in args.turns.split(","))
    systems = []
    for _ in range(args.system_prompts):
        start = where.randrange(max(1, len(text) - args.system_chars))
        systems.append("You answer questions about this document.\n\n" + text[start : start + args.system_chars])
    out = []
    for _ in range(args.conversations):
        system, n = shape.randrange(len(systems)), shape.randint(lo, hi)
        sizes = [shape.randint(8, max(8, args.user_words)) for _ in range(n)]
        think = tuple(shape.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in range(n - 1))
        starts = [where.randrange(max(1, len(words) - k)) for k in sizes]
        users = tuple("Explain: " + " ".join(words[i : i + k]) for i, k in zip(starts, sizes))
        out.append(Conversation(systems[system], users, think))
    return out


# ---------------------------------------------------------------------------------------------- the client
def chat_turn(client, url: str, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streaming chat request: TTFT (sent to the first content), the reply, its tokens, the whole request's time."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    ttft, parts, tokens = None, [], 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            for choice in msg.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    parts.append(piece)
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
    return {"ttft_s": ttft, "reply": "".join(parts), "tokens": tokens, "seconds": time.monotonic() - t0}


def run_conversations(url: str, model: str, convs: list[Conversation], args, history=None) -> list[list[dict]]:
    """Every conversation in a thread of its own, started ``args.gap_s`` apart: each turn waits its think time, then
    sends the conversation so far. ``history[c][k]``: the reply to put in turn k's place in what later turns send
    (another run's), instead of the reply received. Returns each conversation's turns."""
    import httpx

    def one(c: int) -> list[dict]:
        time.sleep(c * args.gap_s)
        conv, messages, turns = convs[c], [{"role": "system", "content": convs[c].system}], []
        with httpx.Client() as client:
            for k, user in enumerate(conv.users):
                if k:
                    time.sleep(conv.think_s[k - 1])
                messages.append({"role": "user", "content": user})
                turn = chat_turn(client, url, model, messages, args.max_tokens)
                turns.append(turn)
                reply = history[c][k]["reply"] if history is not None else turn["reply"]
                messages.append({"role": "assistant", "content": reply})
        return turns

    with ThreadPoolExecutor(len(convs)) as pool:
        return list(pool.map(one, range(len(convs))))


def counters(url: str) -> dict[str, float]:
    """The replicas' prefix-cache queries and hits, and tokens evicted, summed over replicas, from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {"queries": 0.0, "hits": 0.0, "evicted": 0.0}
    names = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
             "vtoken:tokens_evicted_total": "evicted"}  # fmt: skip
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def phase(url: str, model: str, convs: list[Conversation], args, history=None, settle_s: float = 2.5) -> dict:
    """One run of ``convs``: per-turn figures, and the counters' change over it (the replicas report their counters
    at least once a second: ``settle_s`` after the last reply every one of them has)."""
    before = counters(url)
    t0 = time.monotonic()
    turns = run_conversations(url, model, convs, args, history)
    wall = time.monotonic() - t0
    time.sleep(settle_s)
    after = counters(url)
    d = {k: after[k] - before[k] for k in after}
    flat = [t for conv in turns for t in conv]
    later = [t for conv in turns for t in conv[1:]]
    return {
        "turns": len(flat),
        "ttft": ttft_stats(flat),
        "ttft_later_turns": ttft_stats(later),
        "tokens_per_s": sum(t["tokens"] for t in flat) / wall if wall else 0.0,
        "seconds": round(wall, 2),
        "prefix_queries": d["queries"],
        "prefix_hits": d["hits"],
        "hit_rate": d["hits"] / d["queries"] if d["queries"] else None,
        "tokens_evicted": d["evicted"],
        "conversations": turns,
    }


def ttft_stats(turns: list[dict]) -> dict[str, float | None]:
    xs = sorted(t["ttft_s"] for t in turns if t["ttft_s"] is not None)
    if not xs:
        return {"p50_s": None, "p99_s": None, "mean_s": None}
    return {
        "p50_s": xs[len(xs) // 2],
        "p99_s": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
        "mean_s": statistics.fmean(xs),
    }


def agreement(a: list[list[dict]], b: list[list[dict]]) -> dict[str, float]:
    """How far the replies of two runs of the same conversations agree: the share of turns whose replies are equal,
    and the mean share of each reply's characters before the first difference."""
    pairs = [(x["reply"], y["reply"]) for ca, cb in zip(a, b) for x, y in zip(ca, cb)]
    if not pairs:
        return {"equal": 0.0, "common_prefix": 0.0}
    equal = sum(x == y for x, y in pairs) / len(pairs)
    common = statistics.fmean(len(os.path.commonprefix([x, y])) / max(len(x), len(y), 1) for x, y in pairs)
    return {"equal": round(equal, 3), "common_prefix": round(common, 3)}


# ---------------------------------------------------------------------------------------------- the servers
def serve_config(args, name: str, replicas: int, vtoken: dict, kv_bytes: int, strategy: str = "weighted"):
    from cluster.config import parse_config

    raw: dict[str, Any] = {
        "name": name,
        "model": args.model,
        "replicas": replicas,
        "replica": {"num_cpus": 0.5, "pin_cpus": args.engine == "vllm"},
        "placement": {"strategy": strategy},
        "vtoken": vtoken,
        "gateway": {"port": 0, "http_port": "any", "max_inflight": 256},
    }
    if args.engine == "fake":  # a tokenizer for the chat template (the model's), the fake's blocks for the rest
        blocks = max(8, kv_bytes // (64 << 10))
        raw["engine"] = {"kind": "fake", "fake_total_blocks": blocks, "fake_token_delay_s": 0.002,
                         "max_model_len": args.max_model_len}  # fmt: skip
    else:
        raw["engine"] = {"kv_cache_memory_bytes": kv_bytes, "max_model_len": args.max_model_len}
    return parse_config(raw, source="vtoken bench chat")


def run(args) -> dict:
    import ray

    from cluster.placement.placer import SETTLE_S
    from cluster.server import BackgroundServer, start_ray

    a = {**vars(args), **(QUICK if args.quick else {})}
    for k in QUICK:
        setattr(args, k, a[k])
    parts = [x for x in args.parts.split(",") if x]
    if set(parts) - set(PARTS) or not parts:
        raise SystemExit(f"--parts: any of {', '.join(PARTS)}, not {args.parts!r}")
    if "short" in parts and "single" not in parts:
        raise SystemExit("--parts: short compares with single's stock replies; run single too")
    strategies = args.strategies.split(",")
    model = args.model
    load_before = os.getloadavg()
    started_ray = not ray.is_initialized()
    out: dict[str, Any] = {"model": model, "engine": args.engine, "parts": parts, "placement": {}}
    first = serve_config(args, "chat", 2 if "placement" in parts else 1, {}, args.kv_bytes)
    start_ray(first)
    try:
        convs, single = conversations(args, args.seed), {}
        if "placement" in parts or "single" in parts:
            with BackgroundServer(first) as served:
                url = f"http://127.0.0.1:{served.http_port}"
                # 1. placement on two replicas: each strategy on conversations of its own
                for i, s in enumerate(strategies if "placement" in parts else ()):
                    ray.get(served.controller.set_placement.remote(s), timeout=60)
                    time.sleep(SETTLE_S)  # until the gateway places by the new strategy
                    log(f"[placement] {s}: {args.conversations} conversations")
                    out["placement"][s] = phase(url, model, conversations(args, args.seed, args.seed + 1 + i), args)
                if "single" in parts:
                    _single_vtoken(served, url, model, convs, args, single)
        if "single" in parts:
            with BackgroundServer(serve_config(args, "chat-off", 1, {"mode": "off"}, args.kv_bytes)) as served:
                log("[single] vtoken mode off (stock vLLM)")
                single["off"] = phase(f"http://127.0.0.1:{served.http_port}", model, convs, args)
            single["replies_agree"] = agreement(single["vtoken"]["conversations"], single["off"]["conversations"])
            out["single"] = single
        if "short" in parts:
            # 3. a short pool, each turn sent with the full-KV run's history; its replies against the full-KV ones
            with BackgroundServer(serve_config(args, "chat-short", 1, {}, args.short_kv_bytes)) as served:
                log(f"[short pool] {args.short_kv_bytes >> 20} MiB")
                full = single["off"]["conversations"]
                short = phase(f"http://127.0.0.1:{served.http_port}", model, convs, args, history=full)
            short["replies_vs_full_kv"] = agreement(short["conversations"], full)
            out["short_pool"] = {"kv_bytes": args.short_kv_bytes, **short}
    finally:
        if started_ray:
            ray.shutdown()
    out["load"] = {
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    out["workload"] = {k: a[k] for k in ("conversations", "turns", "system_prompts", "system_chars", "user_words",
                                         "max_tokens", "think_s", "gap_s", "kv_bytes", "max_model_len")}  # fmt: skip
    return out


def _single_vtoken(served, url: str, model: str, convs: list[Conversation], args, single: dict) -> None:
    """Part 2's vToken run: one replica with vToken's defaults (after part 1, the same server scaled in: one engine
    start fewer; its cache holds other conversations)."""
    import ray

    ray.get(served.controller.scale.remote(1), timeout=60)
    until = time.monotonic() + 120
    while len(ray.get(served.controller.status.remote(), timeout=60)["replicas"]) > 1:
        if time.monotonic() > until:
            raise RuntimeError("the placement server did not scale in to one replica within 120 s")
        time.sleep(0.5)
    log("[single] vtoken mode vtoken (defaults)")
    single["vtoken"] = phase(url, model, convs, args)


# ---------------------------------------------------------------------------------------------- report
def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def tables(result: dict) -> list[Table]:
    w, load = result["workload"], result["load"]
    shape = (
        f"{w['conversations']} conversations of {w['turns'].replace(',', '-')} turns over {w['system_prompts']} "
        f"system prompts of {w['system_chars']} characters, {w['max_tokens']} tokens a reply, think time "
        f"{w['think_s']:g} s" + (f", a pool of {w['kv_bytes'] >> 20} MiB per replica" if "kv_bytes" in w else "")
    )
    note = (
        f"Load on the machine ({load['cpus']} CPUs): load average {load['loadavg_before'][0]} before, "
        f"{load['loadavg_after'][0]} after (1 min). TTFT at the client, streaming over HTTP."
    )
    placement = Table(
        f"Placement on 2 replicas ({result['model']}): {shape}",
        ["placement", "turns", "TTFT p50 ms", "TTFT p99 ms", "tokens/s", "prefix hit rate"],
        [
            [
                s,
                r["turns"],
                _ms(r["ttft"]["p50_s"]),
                _ms(r["ttft"]["p99_s"]),
                round(r["tokens_per_s"], 1),
                _pct(r["hit_rate"]),
            ]  # fmt: skip
            for s, r in result["placement"].items()
        ],
        note,
    )
    out = [placement] if result["placement"] else []
    if "single" not in result:
        return out
    one = result["single"]
    agree = one["replies_agree"]
    single = Table(
        "One replica: vToken's defaults against stock vLLM (mode off), the same conversations",
        [
            "vtoken mode",
            "TTFT p50 ms, later turns",
            "TTFT p99 ms, later turns",
            "TTFT p50 ms, all turns",
            "tokens/s",
            "prefix hit rate",
        ],  # fmt: skip
        [
            [
                m,
                _ms(one[m]["ttft_later_turns"]["p50_s"]),
                _ms(one[m]["ttft_later_turns"]["p99_s"]),
                _ms(one[m]["ttft"]["p50_s"]),
                round(one[m]["tokens_per_s"], 1),
                _pct(one[m]["hit_rate"]),
            ]  # fmt: skip
            for m in ("vtoken", "off")
        ],
        f"Later turns: every turn after a conversation's first (what a prefix cache can serve). Replies equal to "
        f"stock's: {_pct(agree['equal'])} of turns (characters before the first difference: "
        f"{_pct(agree['common_prefix'])}).",
    )
    out.append(single)
    if "short_pool" not in result:
        return out
    sp = result["short_pool"]
    vs = sp["replies_vs_full_kv"]
    short = Table(
        f"A short pool ({sp['kv_bytes'] >> 20} MiB, vToken's defaults): eviction runs",
        [
            "turns",
            "TTFT p50 ms",
            "prefix hit rate",
            "tokens evicted",
            "replies equal to full KV's",
            "characters before the first difference",
        ],  # fmt: skip
        [
            [
                sp["turns"],
                _ms(sp["ttft"]["p50_s"]),
                _pct(sp["hit_rate"]),
                int(sp["tokens_evicted"]),
                _pct(vs["equal"]),
                _pct(vs["common_prefix"]),
            ]
        ],  # fmt: skip
        "Every turn sent with the full-KV run's history (stock vLLM, the large pool), so each reply is compared on "
        "the same prompt.",
    )
    return [*out, short]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    names = list(result["placement"])
    p50 = [1000 * (result["placement"][s]["ttft"]["p50_s"] or 0) for s in names]
    p99 = [1000 * (result["placement"][s]["ttft"]["p99_s"] or 0) for s in names]
    xs = range(len(names))
    ax1.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    ax1.set_xticks(list(xs), names)
    ax1.set(ylabel="TTFT, ms", title="placement on 2 replicas")
    ax1.legend(fontsize=7)
    hits = [100 * (result["placement"][s]["hit_rate"] or 0) for s in names]
    labels = list(names)
    if "single" in result:
        modes = ["vtoken", "off"]
        hits += [100 * (result["single"][m]["hit_rate"] or 0) for m in modes]
        labels += [f"1 replica, {m}" for m in modes]
    if "short_pool" in result:
        hits.append(100 * (result["short_pool"]["hit_rate"] or 0))
        labels.append("short pool")
    ax2.barh(range(len(hits)), hits)
    ax2.set_yticks(range(len(hits)), labels, fontsize=7)
    ax2.set(xlabel="prefix hit rate, %", title="prompt tokens read from the cache")
