"""What `vllm serve` answers, `vtoken serve` answers: one request per feature, sent with the `openai` client to stock
vLLM's OpenAI server and to `vtoken serve`, side by side.

On one machine, with the same model, engine settings, tool and reasoning parsers and Responses store:

  stock    stock vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: what `vllm serve` runs)
  off      `vtoken serve`, one replica, vToken off: must answer as stock does (greedy: the same text, the same
           shapes; log-probabilities within 1e-3)
  vtoken   the same with vToken's defaults (not in ``--quick``): eviction under memory pressure only, which one
           request at a time never makes, so every answer is full KV's
  always   vToken evicting every request to ``--budget`` (``evict: always``): the same shapes; a text may differ
           where eviction dropped tokens the answer read

Every answer is reduced to what a client reads (texts, finish reasons, token counts, tool calls, log-probabilities,
an error's status), ids and timestamps left out, and compared with stock's. Each row's request is in the result.
``--quick`` (CI, tests/test_parity.py): tiny-llama, stock and off. A reasoning parser changes every chat answer, so
its rows run on servers of their own (``--reasoning-parser``, not in ``--quick``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET

SERVERS = ("stock", "off", "vtoken", "always")
QUICK = {"model": "tiny-llama", "servers": "stock,off", "reasoning_parser": ""}
TOOL_PARSER = "hermes"
TOLERANCE = 1e-3  # log-probabilities of two servers running the same engine on the same request
MSG = [{"role": "user", "content": "Name three colours of the sea, in one short sentence."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"any of {', '.join(SERVERS)}")
    p.add_argument("--kv-bytes", type=int, default=64 << 20, help="KV pool of every server")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET, help="the always server's budget")
    p.add_argument(
        "--reasoning-parser", default="granite", help="vLLM's reasoning parser of the reasoning rows ('': none)"
    )


# ---------------------------------------------------------------------------------------------- requests
def _chat(c, **kw) -> Any:
    return c.chat.completions.create(model=c.model, **{"messages": MSG, "max_tokens": 16, "temperature": 0, **kw})


def _choices(r) -> list[dict]:
    out = []
    for ch in r.choices:
        m = ch.message
        calls = [(t.function.name, t.function.arguments) for t in (m.tool_calls or [])]
        reasoning = getattr(m, "reasoning", None) or getattr(m, "reasoning_content", None)
        out.append({"text": m.content, "reasoning": reasoning, "finish": ch.finish_reason, "tools": calls})
    return out


def _usage(u) -> list[int]:
    return [u.prompt_tokens, u.completion_tokens]


def _chat_view(r) -> dict:
    return {"choices": _choices(r), "usage": _usage(r.usage)}


def _stream(c, **kw) -> dict:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in _chat(c, stream=True, stream_options={"include_usage": True}, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
        if chunk.usage:
            usage = _usage(chunk.usage)
    return {"texts": texts, "finish": finish, "usage": usage}


def _logprobs(c) -> dict:
    r = _chat(c, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    return {"text": r.choices[0].message.content, "tokens": [t.token for t in lp], "logprobs": [t.logprob for t in lp],
            "top": [[x.token for x in t.top_logprobs] for t in lp]}  # fmt: skip


def _completion_view(r) -> dict:
    out = []
    for ch in r.choices:
        lp = ch.logprobs
        view = {"text": ch.text, "finish": ch.finish_reason}
        if lp is not None:
            view["tokens"], view["logprobs"] = lp.tokens, lp.token_logprobs
        prompt_lp = getattr(ch, "prompt_logprobs", None) or (ch.model_extra or {}).get("prompt_logprobs")
        if prompt_lp is not None:
            view["prompt_logprobs"] = [
                None if p is None else {k: v["logprob"] for k, v in p.items()} for p in prompt_lp
            ]
        out.append(view)
    return {"choices": out, "usage": _usage(r.usage)}


def _complete(c, **kw) -> dict:
    body = {"prompt": "The sea is", "max_tokens": 8, "temperature": 0, **kw}
    return _completion_view(c.completions.create(model=c.model, **body))


def _responses(c, **kw) -> dict:
    r = c.responses.create(model=c.model, input="Say hello to the sea.", max_output_tokens=12, temperature=0, **kw)
    return {"text": r.output_text, "status": r.status, "usage": [r.usage.input_tokens, r.usage.output_tokens]}


def _responses_stream(c) -> dict:
    kinds, text, final = [], "", None
    for event in c.responses.create(model=c.model, input="Say hello.", max_output_tokens=8, temperature=0, stream=True):
        if not kinds or kinds[-1] != event.type:
            kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response.output_text
    return {"events": kinds, "text": text, "final": final}


def _responses_chain(c) -> dict:
    first = c.responses.create(model=c.model, input="My name is Ada.", max_output_tokens=6, temperature=0, store=True)
    again = c.responses.retrieve(first.id)
    follow = c.responses.create(model=c.model, input="What is my name?", max_output_tokens=6, temperature=0,
                                previous_response_id=first.id)  # fmt: skip
    return {"first": first.output_text, "retrieved": again.output_text == first.output_text,
            "follow": follow.output_text, "follow_prompt": follow.usage.input_tokens}  # fmt: skip


def _http(c, path: str, body: dict) -> dict:
    import httpx

    r = httpx.post(str(c.base_url).removesuffix("/v1/") + path, json={"model": c.model, **body}, timeout=120)
    return {"status": r.status_code, "body": r.json()}


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}


def _structured(**kind) -> Callable[[Any], Any]:
    return lambda c: _chat_view(_chat(c, extra_body={"structured_outputs": kind}))


def _chatted(**kw) -> Callable[[Any], Any]:
    return lambda c: _chat_view(_chat(c, **kw))


def _completed(**kw) -> Callable[[Any], Any]:
    return lambda c: _complete(c, **kw)


# name -> (what it sends, the call). Greedy everywhere but the seeded row.
CASES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "chat": ("chat.completions, greedy", _chatted()),
    "chat stream + usage": ("stream=True, include_usage", lambda c: _stream(c)),
    "chat logprobs": ("logprobs, top_logprobs=2", _logprobs),
    "n=2": ("n=2, greedy", _chatted(n=2)),
    "n=2 seeded": ("n=2, temperature 1, seed 7", _chatted(n=2, temperature=1.0, seed=7)),
    "n=2 stream": ("n=2, temperature 1, seed 7, stream", lambda c: _stream(c, n=2, temperature=1.0, seed=7)),
    "json_object": ("response_format json_object", _chatted(response_format={"type": "json_object"})),
    "json_schema": ("response_format json_schema", _chatted(max_tokens=32, response_format=JSON_SCHEMA)),
    "regex": ("structured_outputs.regex", _structured(regex="[a-z]{3} [0-9]{2}")),
    "choice": ("structured_outputs.choice", _structured(choice=["yes", "no"])),
    "tools, named": ("tools, a named tool_choice", _chatted(max_tokens=32, tools=[WEATHER], tool_choice=NAMED_TOOL)),
    "tools, required": ("tools, tool_choice required", _chatted(max_tokens=48, tools=[WEATHER],
                                                                tool_choice="required")),
    "tools, auto": ("tools, tool_choice auto", _chatted(tools=[WEATHER], tool_choice="auto")),
    "completion": ("completions, greedy", _completed()),
    "prompt list": ("completions, a list of 2 prompts", _completed(prompt=["The sea is", "One, two,"])),
    "echo + logprobs": ("echo, logprobs=1", _completed(echo=True, logprobs=1, max_tokens=3)),
    "prompt_logprobs": ("extra_body prompt_logprobs=1", _completed(max_tokens=2, extra_body={"prompt_logprobs": 1})),
    "beam search": ("use_beam_search, n=2", _completed(n=2, max_tokens=6, extra_body={"use_beam_search": True})),
    "stop string": ("stop=['.']", _chatted(max_tokens=32, stop=["."])),
    "responses": ("responses, stateless", lambda c: _responses(c, store=False)),
    "responses stream": ("responses, stream", _responses_stream),
    "responses store": ("store, retrieve, previous_response_id", _responses_chain),
    "tokenize": ("/tokenize, chat", lambda c: _http(c, "/tokenize", {"messages": MSG})),
    "detokenize": ("/detokenize", lambda c: _http(c, "/detokenize", {"tokens": [504, 3094, 314]})),
    "models": ("/v1/models", lambda c: [m.id for m in c.models.list().data]),
    "error: max_tokens": ("max_tokens past max_model_len", _chatted(max_tokens=10**6)),
    "error: model": ("an unknown model", lambda c: c.chat.completions.create(model="nope", messages=MSG, max_tokens=1)),
    "error: n=0": ("n=0", _chatted(n=0)),
}  # fmt: skip
REASONING = {
    "reasoning": ("a reasoning parser, chat", lambda c: _chat_view(_chat(c, max_tokens=24))),
    "reasoning stream": ("a reasoning parser, stream", lambda c: _stream(c, max_tokens=24)),
    "reasoning + json": (
        "a reasoning parser, json_object",
        lambda c: _chat_view(_chat(c, max_tokens=24, response_format={"type": "json_object"})),
    ),
}


def answer(client, call: Callable[[Any], Any]) -> dict:
    """A call's reduced answer, ``{"ok": view}``, or its refusal, ``{"error": status, "type": ..., "message": ...}``."""
    import openai

    try:
        return {"ok": call(client)}
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return {"error": e.status_code, "type": body.get("type"), "message": str(body.get("message", e))[:300]}


def same(a: Any, b: Any, tol: float = TOLERANCE) -> bool:
    """Equal answers: the same structure and values, floats within ``tol``; an error by its status alone."""
    if isinstance(a, dict) and isinstance(b, dict):
        if "error" in a or "error" in b:
            return a.get("error") == b.get("error")
        return a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=tol) or (math.isinf(a) and a == b)
    return a == b


def shape(a: Any) -> Any:
    """An answer's shape: its structure with every string, number and boolean replaced by its type."""
    if isinstance(a, dict):
        return {k: (a[k] if k == "error" else shape(a[k])) for k in a}
    if isinstance(a, list | tuple):
        return [shape(x) for x in a]
    return type(a).__name__


# ---------------------------------------------------------------------------------------------- servers
@contextlib.contextmanager
def _server(kind: str, args, reasoning: str) -> Iterator[str]:
    """One server of ``kind`` with the tool parser, ``reasoning`` (or none) and the Responses store; its URL."""
    from vtoken.bench.serve import stock_server, vtoken_server
    from vtoken.models import model_path

    if kind == "stock":
        flags = ["--tool-call-parser", TOOL_PARSER, "--enable-auto-tool-choice"]
        flags += ["--reasoning-parser", reasoning] if reasoning else []
        with stock_server(args, str(model_path(args.model)), flags, {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}) as url:
            yield url
        return
    on = {"mode": "vtoken"}
    vt = {"off": {"mode": "off"}, "vtoken": on, "always": {**on, "evict": "always", "budget": args.budget}}[kind]
    parsers = {"tool_call_parser": TOOL_PARSER, "enable_auto_tool_choice": True, "reasoning_parser": reasoning or None}
    with vtoken_server(args, 1, vt, engine=parsers, gateway={"responses_store": True}) as url:
        yield url


def _ask(url: str, model: str, cases: dict) -> dict[str, dict]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=300)
    client.model = model
    out = {}
    for name, (_, call) in cases.items():
        t = time.monotonic()
        out[name] = answer(client, call)
        log(f"  {name}: {'ok' if 'ok' in out[name] else out[name]['error']} ({time.monotonic() - t:.1f} s)")
    return out


def run(args) -> dict:
    import ray

    a = {**vars(args), **(QUICK if args.quick else {})}
    for k in QUICK:
        setattr(args, k, a[k])
    servers = args.servers.split(",")
    if servers[0] != "stock":
        raise SystemExit("--servers must start with stock: every answer is compared with stock vLLM's")
    started_ray = not ray.is_initialized()
    answers: dict[str, dict[str, dict]] = {s: {} for s in servers}
    groups = [("", CASES)] + ([(args.reasoning_parser, REASONING)] if args.reasoning_parser else [])
    try:
        for reasoning, cases in groups:
            for s in servers:
                log(f"[{s}] {args.model}" + (f", reasoning parser {reasoning}" if reasoning else ""))
                with _server(s, args, reasoning) as url:
                    answers[s].update(_ask(url, args.model, cases))
    finally:
        if started_ray and ray.is_initialized():
            ray.shutdown()
    rows = []
    for name, (sent, _) in {**CASES, **(REASONING if args.reasoning_parser else {})}.items():
        base = answers["stock"][name]
        row = {"feature": name, "request": sent, "stock": _verdict(base, None)}
        for s in servers[1:]:
            got = answers[s][name]
            row[s] = _verdict(got, base)
        rows.append(row)
    return {"model": args.model, "servers": servers, "tool_call_parser": TOOL_PARSER, "budget": args.budget,
            "reasoning_parser": args.reasoning_parser or None, "rows": rows, "answers": answers}  # fmt: skip


def _verdict(got: dict, base: dict | None) -> str:
    if base is None:
        return f"refused {got['error']}" if "error" in got else "served"
    if same(got, base):
        return f"same refusal ({got['error']})" if "error" in got else "same answer"
    if "error" in got or "error" in base:
        mine = f"refused {got['error']}" if "error" in got else "served"
        theirs = f"refused {base['error']}" if "error" in base else "served"
        return f"DIFFERS: {mine}, stock {theirs}"
    return "same shape, other text" if shape(got) == shape(base) else "DIFFERS in shape"


# ---------------------------------------------------------------------------------------------- report
def tables(result: dict) -> list[Table]:
    servers = result["servers"]
    names = {"stock": "stock `vllm serve`", "off": "`vtoken serve`, vToken off", "vtoken": "`vtoken serve`, defaults",
             "always": f"`vtoken serve`, evict always at {result.get('budget', SHIPPED_BUDGET)}"}  # fmt: skip
    return [
        Table(
            f"What each server answers ({result['model']}; tool parser {result['tool_call_parser']}, reasoning parser "
            f"{result['reasoning_parser'] or 'none'} on its rows)",
            ["feature", "request", *[names[s] for s in servers]],
            [[r["feature"], r["request"], *[r[s] for s in servers]] for r in result["rows"]],
            "Each request sent with the `openai` client (or httpx for /tokenize, /detokenize) to each server in turn; "
            "'same answer': the same texts, finish reasons, token counts, tool calls, and log-probabilities within "
            f"{TOLERANCE}; a refusal by its HTTP status. The requests: vtoken/bench/parity.py CASES.",
        )
    ]


def failures(result: dict, server: str = "off") -> list[str]:
    """The rows where ``server`` does not answer as stock does (tests/test_parity.py: none for ``off``)."""
    return [f"{r['feature']}: {r[server]}" for r in result["rows"] if not r[server].startswith("same answer")
            and not r[server].startswith("same refusal")]  # fmt: skip
