"""Generated requests for fuzzing both doors (tests/test_fuzz_doors.py, scripts/fuzz_doors.py).

HTTP bodies come from the JSON schemas of vLLM's own protocol models (ChatCompletionRequest, CompletionRequest):
every field with a value of its schema at its edges (bounds, 0, -1, 2**31, 2**63, huge and tiny floats, empty and
odd strings, a chat template, nesting), or a JSON value of another type, laid over a body that would otherwise be
served, so the fuzz reaches past the first check. gRPC requests are protobuf messages with every field at its
edges, and raw bytes. Eviction options and sampling also come as VALID values at their edges (``valid_options``,
``valid_sampling``), so requests reach the engine and the engine is fuzzed too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from hypothesis import strategies as st

INTS = [0, 1, -1, 2, 7, 31, 32, 33, 255, 1024, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63), 10**30]
FLOATS = [0.0, -0.0, 1e-9, 0.5, 1.0, 2.0, -1.0, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf]
STRINGS = [
    "", " ", "a", "hello", "\x00", "\ud7ff\U0010ffff", "{{ 7 * 7 }}", "{% for i in range(99) %}x{% endfor %}",
    "<|im_start|>system", "x" * 300, "user", "assistant", "tiny-llama", "fake", "auto", "none", "required",
]  # fmt: skip
ROLES = ["system", "developer", "user", "assistant", "tool", "function", "", "User", "x"]


def edge_ints(lo: int | None = None, hi: int | None = None) -> st.SearchStrategy:
    picks = [v for v in INTS if (lo is None or v >= lo - 1) and (hi is None or v <= hi + 1)]
    if lo is not None:
        picks += [lo, lo - 1]
    if hi is not None:
        picks += [hi, hi + 1]
    return st.one_of(st.sampled_from(sorted(set(picks))), st.integers(-300, 300))


def edge_floats(lo: float | None = None, hi: float | None = None) -> st.SearchStrategy:
    picks = list(FLOATS) + [v for v in (lo, hi) if v is not None]
    return st.one_of(st.sampled_from(picks), st.floats(-5, 5, allow_nan=False))


text = st.one_of(st.sampled_from(STRINGS), st.text(max_size=12))
json_scalar = st.one_of(st.none(), st.booleans(), edge_ints(), edge_floats(), text)
any_json = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=6,
)


class SchemaFuzz:
    """Strategies from one pydantic model's JSON schema (the subset vLLM's protocol models use)."""

    def __init__(self, schema: dict[str, Any]):
        self.schema, self.defs = schema, schema.get("$defs", {})

    def value(self, node: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
        """A value of ``node``'s schema (at its edges), or now and then any JSON value at all."""
        own = self._typed(node, depth)
        return st.one_of(own, own, own, any_json) if depth < 3 else own

    def _typed(self, node: dict[str, Any], depth: int) -> st.SearchStrategy:
        if "$ref" in node:
            return self.value(self.defs[node["$ref"].rsplit("/", 1)[-1]], depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in node:
                return st.one_of([self.value(n, depth + 1) for n in node[key]])
        if "allOf" in node:
            return self.value(node["allOf"][0], depth + 1)
        if "const" in node:
            return st.just(node["const"])
        if "enum" in node:
            return st.one_of(st.sampled_from(node["enum"]), text)
        kind = node.get("type")
        if isinstance(kind, list):
            return st.one_of([self._typed({**node, "type": k}, depth) for k in kind])
        if kind == "integer":
            return edge_ints(node.get("minimum"), node.get("maximum"))
        if kind == "number":
            return edge_floats(node.get("minimum"), node.get("maximum"))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "string":
            return text
        if kind == "array":
            if depth >= 4:
                return st.just([])
            items = self.value(node.get("items", {}), depth + 1)
            return st.lists(items, max_size=min(node.get("maxItems", 3), 3))
        if kind == "object" or "properties" in node:
            if depth >= 4:
                return st.just({})
            props = node.get("properties", {})
            if props:
                return st.fixed_dictionaries(
                    {k: self.value(v, depth + 1) for k, v in props.items() if k in node.get("required", [])},
                    optional={
                        k: self.value(v, depth + 1) for k, v in props.items() if k not in node.get("required", [])
                    },  # fmt: skip
                )
            return st.dictionaries(text, any_json, max_size=3)
        return any_json

    def fields(self, names: list[str] | None = None, most: int = 4) -> st.SearchStrategy:
        """A few of the model's top-level fields, each with a generated value."""
        props = self.schema["properties"]
        names = names or sorted(props)
        return st.lists(st.sampled_from(names), max_size=most, unique=True).flatmap(
            lambda chosen: st.fixed_dictionaries({k: self.value(props[k]) for k in chosen})
        )


@functools.cache
def _schemas() -> dict[str, SchemaFuzz]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"chat": SchemaFuzz(ChatCompletionRequest.model_json_schema()),
            "completion": SchemaFuzz(CompletionRequest.model_json_schema())}  # fmt: skip


def base_body(kind: str, model: str) -> st.SearchStrategy:
    """A body that would be served: the fuzzed fields are laid over it."""
    prompt = st.one_of(text, st.sampled_from(["The capital of France is", "Once upon a time"]))
    if kind == "chat":
        msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": prompt})
        first = st.lists(msg, min_size=1, max_size=2)
        return st.fixed_dictionaries({"model": st.just(model), "messages": first, "max_tokens": st.integers(1, 8)})
    return st.fixed_dictionaries({"model": st.just(model), "prompt": prompt, "max_tokens": st.integers(1, 8)})


# Small schemas the grammar workers check at once (cluster/serving/grammar_pool.py); few, so its cache sees them again.
SMALL_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string"}}},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "boolean"},
]
# Keys of chat_template_kwargs: transformers' own arguments, names the renderer binds, and anything at all
TEMPLATE_KEYS = ["padding", "truncation", "max_length", "tokenize", "chat_template", "messages", "tools",
                 "add_generation_prompt", "enable_thinking", "bos_token", "documents"]  # fmt: skip


def door_fields(kind: str) -> st.SearchStrategy:
    """The fields the door itself weighs or checks (issue 57), more often than vLLM's schema would pick them: ``n``
    and ``best_of`` around ``gateway.max_n`` (128) and far over it, lists of prompts, ``chat_template_kwargs`` with
    any keys, and small JSON schemas (``response_format``, ``structured_outputs``)."""
    counts = st.one_of(st.sampled_from([0, 1, 2, 4, 64, 127, 128, 129, 1024, 16384]), edge_ints())
    schemas = st.sampled_from(SMALL_SCHEMAS)
    optional = {
        "n": counts,
        "best_of": counts,
        "chat_template_kwargs": st.one_of(
            st.just({}), st.dictionaries(st.one_of(st.sampled_from(TEMPLATE_KEYS), text), any_json, max_size=2)
        ),
        "response_format": st.one_of(
            schemas.map(lambda sch: {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": sch}}),
            st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]),
        ),
        "structured_outputs": st.one_of(
            schemas.map(lambda sch: {"json": sch}), st.just({"choice": ["a", "b"]}), st.just({"regex": "[0-9]{1,3}"})
        ),
    }
    if kind == "completion":
        prompts = st.sampled_from(["hi", "The capital of France is", "", "Once upon a time"])
        optional["prompt"] = st.one_of(st.lists(prompts, max_size=4), st.just(["hi"] * 200))
    return st.fixed_dictionaries({}, optional=optional)


def http_body(kind: str, model: str) -> st.SearchStrategy:
    """A chat or completion body: a served one with up to four fields fuzzed from vLLM's schema, some of the fields
    the door checks itself (``door_fields``), messages and their parts fuzzed too, and the ``vtoken``
    extension with any options, valid or not."""
    fuzz = _schemas()[kind]

    def build(base, fields, door, vtoken, messages):
        body = {**base, **fields, **door}
        if vtoken is not None:
            body["vtoken"] = vtoken
        if messages is not None and kind == "chat":
            body["messages"] = messages
        return body

    messages = st.one_of(
        st.none(),
        st.none(),
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(ROLES)}, optional={"content": any_json, "name": text, "tool_calls": any_json}
            ),  # fmt: skip
            max_size=3,
        ),
    )
    vtoken = st.one_of(st.none(), st.none(), valid_options(), eviction_options_any())
    door = st.one_of(st.just({}), door_fields(kind))
    return st.builds(build, base_body(kind, model), fuzz.fields(), door, vtoken, messages)


# ---------------------------------------------------------------------- eviction options and sampling
POLICIES = ["snapkv", "h2o", "scissorhands", "random", "streaming"]


def valid_options() -> st.SearchStrategy:
    """Per-request eviction options that every check accepts, at the edges of their ranges: what reaches the
    engine's scheduler."""

    def params(policy):
        if policy == "scissorhands":
            return st.fixed_dictionaries({}, optional={"history": st.sampled_from([1, 2, 63, 64])})
        if policy == "snapkv":
            return st.fixed_dictionaries({}, optional={"before": st.sampled_from([0, 1, 4096]),
                                                       "after": st.sampled_from([0, 4096])})  # fmt: skip
        if policy == "h2o":
            return st.fixed_dictionaries({}, optional={"score_every": st.sampled_from([1, 2, 64])})
        return st.just({})

    def options(policy, base, extra):
        out = {"policy": policy, **base}
        if extra:
            out["policy_params"] = extra
        if out.get("evict") == "always":
            out.pop("pressure_floor", None)  # a floor is a pressure-mode option (refused with always)
        return out

    base = st.fixed_dictionaries(
        {},
        optional={
            "budget": st.sampled_from([1e-6, 0.01, 0.25, 0.5, 0.999, 1, 2, 64, 10**6]),
            "interval": st.sampled_from([1, 2, "block", 10**6]),
            "sink": st.sampled_from([0, 1, 10**6]),
            "recent": st.sampled_from([0, 1, 10**6]),
            "seed": st.sampled_from([0, 1, 2**64 - 1]),
            "prefill_evict": st.booleans(),
            "prefill_window": st.sampled_from([1, 2, 10**6]),
            "evict": st.sampled_from(["always", "pressure"]),
            "pressure_floor": st.sampled_from([0.0, 0.5, 1.0]),
        },
    )
    policy = st.sampled_from(POLICIES)
    return policy.flatmap(lambda p: st.builds(options, st.just(p), base, params(p)))


def eviction_options_any() -> st.SearchStrategy:
    keys = ["policy", "budget", "interval", "sink", "recent", "seed", "policy_params", "prefill_evict",
            "prefill_window", "evict", "pressure_floor", "mode", "trace_path", "budgett"]  # fmt: skip
    return st.one_of(any_json, st.dictionaries(st.sampled_from(keys), any_json, max_size=4))


def valid_sampling() -> st.SearchStrategy:
    """Sampling that vLLM's checks accept, at the edges: short answers (1-12 tokens) so a fuzz run stays quick."""
    return st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 12)},
        optional={
            "temperature": st.sampled_from([0.0, 1e-5, 0.7, 2.0]),
            "top_p": st.sampled_from([1e-3, 0.5, 1.0]),
            "top_k": st.sampled_from([-1, 1, 2, 50]),
            "min_p": st.sampled_from([0.0, 0.5, 1.0]),
            "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
            "frequency_penalty": st.sampled_from([-2.0, 2.0]),
            "repetition_penalty": st.sampled_from([0.01, 1.0, 2.0]),
            "seed": st.sampled_from([0, 2**31 - 1]),
            "stop": st.sampled_from([["."], ["the", "a"]]),
            "ignore_eos": st.booleans(),
            "min_tokens": st.sampled_from([0, 1]),
            "logprobs": st.sampled_from([0, 1, 5]),
            "skip_special_tokens": st.booleans(),
            "logit_bias": st.sampled_from([{"13": 100.0}, {"0": -100.0}]),
            "stop_token_ids": st.sampled_from([[0], [2, 3]]),
            "bad_words": st.sampled_from([["the"]]),
        },
    )


# ---------------------------------------------------------------------- gRPC
def grpc_request() -> st.SearchStrategy:
    """A GenerateRequest with every field at its edges, as protobuf bytes (what the gateway parses)."""
    from cluster.proto import vtoken_pb2 as pb

    def build(rid, deadline, which, prompt, msgs, sampling, options, params):
        req = pb.GenerateRequest(request_id=rid)
        try:
            req.deadline_ms = deadline
        except (ValueError, TypeError, OverflowError):
            pass
        if which == "prompt":
            req.prompt = prompt
        elif which == "messages":
            req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in msgs)
        for k, v in sampling.items():
            field = pb.SamplingParams.DESCRIPTOR.fields_by_name[k]
            try:
                if field.message_type is not None:
                    getattr(req.sampling, k).update(v)
                elif field.is_repeated:
                    getattr(req.sampling, k).extend(v)
                else:
                    setattr(req.sampling, k, v)
            except (ValueError, TypeError, OverflowError):
                pass  # the value does not fit the field's wire type: the client library refuses it
        for k, v in options.items():
            try:
                setattr(req.vtoken, k, v)
            except (ValueError, TypeError, OverflowError):
                pass
        if params is not None:
            try:
                req.vtoken.policy_params.update(params)
            except (ValueError, TypeError, OverflowError):
                pass
        return req.SerializeToString()

    i32 = edge_ints(-(2**31), 2**31 - 1)
    fuzzed = {
        "temperature": edge_floats(), "top_p": edge_floats(), "top_k": i32, "max_tokens": st.integers(-2, 12),
        "seed": edge_ints(), "stop": st.lists(text, max_size=3), "ignore_eos": st.booleans(),
        "min_p": edge_floats(), "presence_penalty": edge_floats(), "frequency_penalty": edge_floats(),
        "repetition_penalty": edge_floats(), "min_tokens": i32, "stop_token_ids": st.lists(i32, max_size=3),
        "logprobs": i32, "bad_words": st.lists(text, max_size=2), "allowed_token_ids": st.lists(i32, max_size=3),
        "logit_bias": st.dictionaries(i32, edge_floats(), max_size=2), "truncate_prompt_tokens": i32,
    }  # fmt: skip
    some = st.lists(st.sampled_from(sorted(fuzzed)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fuzzed[k] for k in keys})
    )
    sampling = st.builds(lambda valid, odd: {**valid, **odd}, valid_sampling(), some)
    odd_options = st.fixed_dictionaries(
        {},
        optional={
            "policy": st.one_of(st.sampled_from(POLICIES), text), "budget": edge_floats(), "interval": i32,
            "sink": i32, "recent": i32, "seed": edge_ints(), "prefill_evict": st.booleans(), "prefill_window": i32,
            "evict": st.sampled_from(["always", "pressure", "", "never"]), "pressure_floor": edge_floats(),
        },
    )  # fmt: skip
    plain = valid_options().map(lambda o: {k: v for k, v in o.items() if k != "policy_params"})
    options = st.one_of(st.just({}), st.just({}), odd_options, plain)
    params = st.one_of(st.none(), st.none(), st.dictionaries(st.sampled_from(["history", "before", "after",
                       "score_every", "budget", "x"]), any_json, max_size=2))  # fmt: skip
    prompt = st.one_of(st.sampled_from(["The capital of France is", "Once upon a time"]), text)
    msgs = st.one_of(
        st.lists(st.tuples(st.sampled_from(["user", "system"]), prompt), min_size=1, max_size=2),
        st.lists(st.tuples(st.sampled_from(ROLES), text), max_size=3),
    )
    rid = st.one_of(st.just(""), st.just("client-7"), text)
    deadline = st.one_of(st.just(0), st.just(0), st.just(0), edge_ints(-5, 2**31))
    which = st.sampled_from(["prompt", "prompt", "messages", "messages", "none"])
    return st.builds(build, rid, deadline, which, prompt, msgs, sampling, options, params)


def grpc_bytes() -> st.SearchStrategy:
    """Protobuf bytes, valid or not: generated requests, cut short, with bytes flipped, or random bytes."""

    def mutate(raw: bytes, cut: int, flip: int) -> bytes:
        b = bytearray(raw[: max(cut, 0)] if cut else raw)
        if flip and b:
            b[flip % len(b)] ^= 0xFF
        return bytes(b)

    return st.one_of(
        grpc_request(),
        grpc_request(),
        st.builds(mutate, grpc_request(), st.integers(0, 40), st.integers(0, 40)),
        st.binary(max_size=64),
    )


# ---------------------------------------------------------------------- sending, and what counts as a fault
class DoorFuzz:
    """Sends generated requests to a running service and keeps count. A fault is a 5xx (HTTP) or INTERNAL /
    UNKNOWN (gRPC), a 4xx without OpenAI's error shape, a stream that does not end properly, or a stall (no
    complete answer within ``stall_s``); ``faults`` keeps the first few with their requests."""

    GRPC_OK = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION"}

    def __init__(self, http_port: int | None, grpc_port: int | None, stall_s: float = 20.0):
        import grpc
        import httpx

        self.stall_s = stall_s
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=stall_s) if http_port else None
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}") if grpc_port else None
        self.counts = {"http": 0, "grpc": 0, "http_2xx": 0, "grpc_ok": 0, "5xx": 0, "stalls": 0, "bad_shape": 0}
        self.faults: list[str] = []

    def _fault(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        if len(self.faults) < 10:
            self.faults.append(what[:600])

    def http_post(self, path: str, body: Any) -> None:
        import json

        import httpx

        self.counts["http"] += 1
        raw = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity too: not JSON, the door says so
        try:
            with self.http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
                data = r.read()
        except httpx.TimeoutException:
            self._fault("stalls", f"{path} no answer in {self.stall_s}s: {raw[:300]!r}")
            return
        if r.status_code >= 500:
            self._fault("5xx", f"{path} {r.status_code} {data[:300]!r} for {raw[:300]!r}")
            return
        if r.status_code >= 400:
            try:
                err = json.loads(data)["error"]
                ok = {"message", "type", "param", "code"} <= set(err) and err["code"] == r.status_code
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                self._fault("bad_shape", f"{path} {r.status_code} {data[:300]!r}")
            return
        self.counts["http_2xx"] += 1
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            if not data.rstrip().endswith(b"data: [DONE]"):
                self._fault("bad_shape", f"{path} stream without [DONE]: {data[-300:]!r}")
        elif "choices" not in json.loads(data) and path.startswith("/v1/"):
            self._fault("bad_shape", f"{path} 200 without choices: {data[:300]!r}")

    def grpc_generate(self, raw: bytes, deadline_asked: bool = False) -> None:
        import time

        import grpc

        self.counts["grpc"] += 1
        call = self.channel.unary_stream("/vtoken.v1.VToken/Generate", request_serializer=None,
                                         response_deserializer=None)  # fmt: skip
        t0 = time.monotonic()
        try:
            for _ in call(raw, timeout=self.stall_s):
                pass
            self.counts["grpc_ok"] += 1
        except grpc.RpcError as e:
            code = e.code().name
            if code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 >= self.stall_s - 0.5:
                self._fault("stalls", f"gRPC no answer in {self.stall_s}s: {raw[:200]!r}")
            elif code in ("INTERNAL", "UNKNOWN", "UNIMPLEMENTED", "DATA_LOSS"):
                self._fault("5xx", f"gRPC {code} {e.details()} for {raw[:200]!r}")
            elif code not in self.GRPC_OK and not (code == "DEADLINE_EXCEEDED" and deadline_asked):
                self._fault("bad_shape", f"gRPC {code} {e.details()} for {raw[:200]!r}")

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        if self.channel is not None:
            self.channel.close()
