"""The request model both doors share (cluster/requests.py), without a server: every sampling field vLLM serves
reaches ``vllm.SamplingParams`` through the HTTP door and the gRPC door alike, neutral values are never refused,
what cannot work is refused by name, the crossing to the replica rebuilds an equal SamplingParams, deeply nested
JSON is a clean BadRequest, and /tokenize and /detokenize round-trip on a real tokenizer."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from cluster.config import parse_config
from cluster.grpc_requests import parse, validate
from cluster.openai_requests import chat_request, completion_request, load_json, tokenize_response
from cluster.proto import vtoken_pb2 as pb
from cluster.requests import BadRequest, Tokenizer, sampling_kwargs

CFG = parse_config({"model": "fake", "engine": {"kind": "fake"}})
TOK = Tokenizer(None)
MSG = [{"role": "user", "content": "hi"}]

# field -> (neutral value, another value, what SamplingParams then holds for it). The neutral values are what
# clients such as vLLM's own benchmark send (its completions requests carry "repetition_penalty": 1.0).
FIELDS = {
    "repetition_penalty": (1.0, 1.3, 1.3),
    "min_p": (0.0, 0.2, 0.2),
    "min_tokens": (0, 3, 3),
    "stop_token_ids": ([], [7, 9], [7, 9]),
    "include_stop_str_in_output": (False, True, True),
    "skip_special_tokens": (True, False, False),
    "spaces_between_special_tokens": (True, False, False),
    "presence_penalty": (0.0, 0.5, 0.5),
    "frequency_penalty": (0.0, -0.5, -0.5),
    "top_k": (0, 5, 5),
    "top_p": (1.0, 0.5, 0.5),
    "temperature": (1.0, 0.7, 0.7),
    "seed": (None, 11, 11),
    "stop": ([], ["zz"], ["zz"]),
    "ignore_eos": (False, True, True),
    "bad_words": ([], ["bad"], ["bad"]),
    "allowed_token_ids": (None, [1, 2, 3], [1, 2, 3]),
    "logit_bias": ({}, {"5": 2.5}, {5: 2.5}),
}


def engine_params(valid) -> SamplingParams:
    """What the replica builds from what crossed to it (actors/engines.py VLLMEngine)."""
    return SamplingParams.from_optional(**valid.spec_sampling())


def http(body: dict, kind: str = "completion"):
    if kind == "chat":
        return chat_request({"messages": MSG, **body}, CFG, TOK).valid
    return completion_request({"prompt": "hello", **body}, CFG, TOK).valid


def grpc_valid(**sampling):
    msg = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(**sampling))
    return validate(parse(msg.SerializeToString()), TOK, CFG.engine.max_model_len, CFG.gateway.max_prompt_chars)


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("which", ["neutral", "set"])
def test_every_sampling_field_reaches_vllms_sampling_params_through_both_doors(name, which):
    neutral, other, expected = FIELDS[name]
    value = neutral if which == "neutral" else other
    want = getattr(SamplingParams.from_optional(), name) if which == "neutral" else expected
    for kind in ("completion", "chat"):
        got = getattr(engine_params(http({name: value}, kind)), name)
        assert got == want or (which == "neutral" and not got and not want), kind
    if name == "logit_bias":
        value = {int(k): v for k, v in value.items()}  # a proto map of token id -> bias
    if value is None or value == [] or value == {}:
        return  # proto3 has no "set to empty": the field is simply absent
    assert getattr(engine_params(grpc_valid(**{name: value})), name) == want


def test_vllms_benchmark_clients_body_is_served():
    """vLLM 0.32's `vllm bench serve --backend openai` sends exactly this (vllm/benchmarks/lib/
    endpoint_request_func.py async_request_openai_completions); the old door refused it with a 400."""
    body = {
        "model": "fake",
        "prompt": "hello there",
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    r = completion_request(body, CFG, TOK)
    assert r.stream and r.include_usage and r.valid.max_tokens == 8
    p = engine_params(r.valid)
    assert p.repetition_penalty == 1.0 and p.ignore_eos and p.max_tokens == 8


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("completion", {"n": 2}, "n"),
        ("completion", {"use_beam_search": True}, "use_beam_search"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("completion", {"suffix": "!"}, "suffix"),
        ("completion", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("chat", {"vllm_xargs": {"vtoken": "h2o"}}, "vllm_xargs"),
    ],
)
def test_what_cannot_work_is_refused_by_name(kind, body, param):
    with pytest.raises(BadRequest) as e:
        http(body, kind)
    assert e.value.param == param and param in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kind, body",
    [
        ("completion", {"n": 1, "use_beam_search": False, "echo": False, "suffix": None, "prompt_logprobs": None}),
        ("chat", {"tool_choice": "none", "response_format": None, "parallel_tool_calls": True, "logprobs": False}),
        ("chat", {"user": "me", "metadata": {"k": "v"}, "service_tier": "auto", "store": False}),
    ],
)
def test_neutral_values_of_refused_fields_and_informational_fields_pass(kind, body):
    assert http(body, kind).max_tokens > 0


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_vllms_own_checks_refuse_bad_values_naming_the_field(body, needle):
    with pytest.raises(BadRequest) as e:
        http(body)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_what_crosses_to_the_replica_rebuilds_an_equal_sampling_params():
    cases = [
        {},
        {"temperature": 0.0, "top_k": 5, "min_p": 0.3},  # greedy: vLLM resets top_k and min_p; so must we
        {"temperature": 0.8, "top_p": 0.9, "seed": -1, "stop": "x", "logprobs": 3, "logit_bias": {"3": 200}},
        {"repetition_penalty": 1.2, "bad_words": ["a", "a"], "stop_token_ids": [4, 4, 5], "min_tokens": 2},
        {"include_stop_str_in_output": True, "skip_special_tokens": False, "extra_args": {"k": 1}},
    ]
    for kw in cases:
        params = SamplingParams.from_optional(**kw)
        sent = sampling_kwargs(params)
        again = SamplingParams.from_optional(**sent)
        assert {f: getattr(again, f) for f in again.__struct_fields__} == {
            f: getattr(params, f) for f in params.__struct_fields__
        }, kw
    assert sampling_kwargs(SamplingParams.from_optional()) == {}


def test_token_ids_prompt_truncation_and_the_developer_role():
    assert http({"prompt": [5, 6, 7, 8]}).prompt_token_ids == [5, 6, 7, 8]
    assert http({"prompt": "abcdef", "truncate_prompt_tokens": 2}).prompt_token_ids == list(b"ef")
    dev = chat_request({"messages": [{"role": "developer", "content": "be brief"}, *MSG]}, CFG, TOK).valid
    sysm = chat_request({"messages": [{"role": "system", "content": "be brief"}, *MSG]}, CFG, TOK).valid
    assert dev.prompt_token_ids == sysm.prompt_token_ids
    msg = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="developer", content="x")]))
    assert validate(parse(msg.SerializeToString()), TOK, 1024, 1000).prompt_token_ids == list(b"<system>x")


@pytest.mark.parametrize("depth", [1000, 50_000])
def test_deeply_nested_json_is_a_bad_request_not_a_crash(depth):
    raw = b"{" + b'"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    try:
        body = load_json(raw)
    except BadRequest as e:
        assert "nested too deeply" in str(e)
        return
    with pytest.raises(BadRequest):  # shallow enough to parse: vLLM's model refuses the shape
        completion_request(body, CFG, TOK)


def test_tokenize_and_detokenize_round_trip_on_a_real_tokenizer():
    from vtoken.models import model_path

    tok = Tokenizer(str(model_path("tiny-llama")))
    cfg = parse_config({"model": "tiny-llama"})
    r = tokenize_response("tokenize", {"model": "tiny-llama", "prompt": "The capital of France"}, cfg, tok)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == cfg.engine.max_model_len
    assert r["tokens"] == tok.encode("The capital of France")
    bare = tokenize_response("tokenize", {"prompt": "The capital of France", "add_special_tokens": False}, cfg, tok)
    assert bare["tokens"] == tok.tok.encode("The capital of France", add_special_tokens=False)
    back = tokenize_response("detokenize", {"tokens": bare["tokens"]}, cfg, tok)
    assert back == {"prompt": "The capital of France"}
    chat = tokenize_response("tokenize", {"messages": MSG, "return_token_strs": True}, cfg, tok)
    valid = chat_request({"messages": MSG}, cfg, tok).valid
    assert chat["tokens"] == valid.prompt_token_ids and len(chat["token_strs"]) == chat["count"]
    with pytest.raises(BadRequest):
        tokenize_response("detokenize", {"tokens": [-1]}, cfg, tok)


# ------------------------------------------------------------------ chat_template_kwargs (issue 46)
SMUGGLED = "X {{ messages[0].content }}"


@pytest.fixture(scope="module")
def real():
    from vtoken.models import model_path

    return Tokenizer(str(model_path("tiny-llama"))), parse_config({"model": "tiny-llama"})


@pytest.mark.parametrize("name", ["chat_template", "tokenize", "tools", "documents", "messages", "return_dict"])
@pytest.mark.parametrize("door", ["chat", "tokenize"])
def test_chat_template_kwargs_cannot_smuggle_an_argument_of_the_renderer(real, name, door):
    """Before: chat_template_kwargs={"chat_template": ...} rendered the client's template (/tokenize answered 5
    tokens), and tools and documents got past their own refusals the same way."""
    tok, cfg = real
    value = {"chat_template": SMUGGLED, "tokenize": True, "tools": [{"type": "function"}],
             "documents": [{"text": "d"}], "messages": [], "return_dict": True}[name]  # fmt: skip
    body = {"messages": MSG, "chat_template_kwargs": {name: value}}
    with pytest.raises(BadRequest) as e:
        if door == "chat":
            chat_request(body, cfg, tok)
        else:
            tokenize_response("tokenize", body, cfg, tok)
    assert e.value.param == f"chat_template_kwargs.{name}" and str(e.value).startswith(e.value.param + ": ")


def test_chat_template_kwargs_pass_only_what_the_models_template_reads(real):
    tok, cfg = real
    plain = chat_request({"messages": MSG}, cfg, tok).valid.prompt_token_ids
    unread = chat_request({"messages": MSG, "chat_template_kwargs": {"enable_thinking": True, "x": "y" * 100}}, cfg,
                          tok).valid.prompt_token_ids  # fmt: skip
    assert unread == plain, "variables the model's template does not read are dropped, as vLLM drops them"
    assert tok.template_variables() == {"messages", "add_generation_prompt"}


def test_a_template_variable_the_template_reads_reaches_it():
    from types import SimpleNamespace

    class Stub:
        chat_template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"

        def apply_chat_template(self, conversation, chat_template=None, tokenize=True, add_generation_prompt=False,
                                continue_final_message=False, **kwargs):  # fmt: skip
            return ("LOUD " if kwargs.get("shout") else "") + conversation[0]["content"]

        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    tok = Tokenizer(None)
    tok.tok = Stub()
    req = SimpleNamespace(add_generation_prompt=True, continue_final_message=False, add_special_tokens=False,
                          chat_template_kwargs={"shout": True, "whisper": True})  # fmt: skip
    from cluster.requests import chat_ids

    assert bytes(chat_ids(req, [{"role": "user", "content": "hi"}], tok)) == b"LOUD hi"
    assert tok.template_variables() == {"shout", "messages"}


# ------------------------------------------------------------------ found by the fuzz (tests/test_fuzz_doors.py)
def test_a_body_that_trips_a_vllm_validator_is_a_400_not_a_500():
    """{"structured_outputs": true} raised AttributeError inside vLLM's CompletionRequest validator: a 500 before."""
    with pytest.raises(BadRequest, match="does not fit vLLM's CompletionRequest"):
        completion_request({"prompt": "hi", "structured_outputs": True, "max_tokens": 2}, CFG, TOK)


@pytest.mark.parametrize(
    "kind, body, field",
    [
        ("completion", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("completion", {"prompt": "hi", "prompt_logprobs": 2**31 - 1}, None),  # refused by name as unserved
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2**31 - 1},
            "top_logprobs",
        ),  # fmt: skip
    ],
)
def test_more_log_probabilities_than_max_logprobs_are_refused_at_the_door(kind, body, field):
    """As vLLM's server refuses them (SamplingParams._validate_logprobs, max_logprobs 20 by default). A gRPC
    request asking 2**31 - 1 reached the fake engine, which then built that many alternatives and stalled."""
    parse = chat_request if kind == "chat" else completion_request
    with pytest.raises(BadRequest) as e:
        parse({**body, "max_tokens": 2}, CFG, TOK)
    assert field is None or e.value.param == field


def test_grpc_log_probabilities_are_bounded_too():
    from cluster.grpc_requests import validate
    from cluster.proto import vtoken_pb2 as pb

    req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2, logprobs=2**31 - 1))
    with pytest.raises(BadRequest, match="max_logprobs"):
        validate(req, TOK, 512, 1000)
    assert validate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2, logprobs=20)), TOK, 512,
                    1000).sampling["logprobs"] == 20  # fmt: skip
