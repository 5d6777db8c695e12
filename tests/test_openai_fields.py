"""Every field vLLM 0.32 accepts, accepted: an audit of the HTTP door against vLLM's own protocol models.

For every field of ``ChatCompletionRequest`` and ``CompletionRequest`` a value that asks for something (not a
neutral one) goes through the request model both doors share (cluster/requests.py). It is either served (or,
like vLLM's informational fields, ignored) or refused by name, and then the feature it belongs to is one the
clients page (docs/clients.md) names under "Refused by name". A field vLLM adds later fails the audit until it is
put in one column or the other. Then the request bodies GuideLLM 0.8.1 and AIPerf 0.13.0 really send (captured
from the tools, tests/data/openai_clients/) go to a served door as they are; GuideLLM's
``stream_options.continuous_usage_stats`` (refused before: 12 of 12 of its requests got a 400) is served as vLLM
serves it, the usage in every chunk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from cluster_harness import config, ensure_ray

from cluster.requests import BadRequest, Limits, Tokenizer, chat, completion
from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]
CLIENTS = Path(__file__).parent / "data" / "openai_clients"
MSG = [{"role": "user", "content": "hi"}]
LIMITS = Limits(max_model_len=512, max_prompt_chars=10_000)

# A value that asks for something, per field, for both request models (where a field is in both, one value).
SAMPLES = {
    # what a request is
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"},
                 {"type": "input_text", "text": "there"}]}],
    "prompt": "hello", "model": "fake", "stream": True, "stream_options": {"include_usage": True,
    "continuous_usage_stats": True},
    # sampling: vLLM's to_sampling_params
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.9,
    "top_k": 5, "min_p": 0.1, "seed": 3, "stop": ["\n\n"], "stop_token_ids": [2], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 2, "max_tokens": 8, "max_completion_tokens": 8, "logit_bias": {"5": 1.0},
    "logprobs": True, "top_logprobs": 2, "allowed_token_ids": [5, 6, 7], "bad_words": ["zz"],
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 100,
    "truncation_side": "right", "length_penalty": 1.0, "vllm_xargs": {"note": "x"}, "n": 1,
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "thinking_token_budget": 16,
    "watermarking": True,
    # the prompt's rendering
    "add_generation_prompt": False, "continue_final_message": False, "add_special_tokens": True,
    "chat_template_kwargs": {"enable_thinking": False},
    # informational, or shapes of the answer the doors do not change: accepted and ignored, as vLLM ignores what
    # it does not use
    "user": "someone", "priority": 0, "request_id": "client-7", "session_id": "s-1", "cache_salt": "salt",
    "reasoning_effort": "low", "include_reasoning": False, "parallel_tool_calls": False, "tool_choice": "none",
    "response_format": {"type": "text"}, "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"k": 1},
    "return_tokens_as_token_ids": True, "return_token_ids": True, "return_token_offsets": True,
    "return_prompt_text": True, "return_mm_kwargs": False, "routed_experts_prompt_start": 2,
    "kv_transfer_params": {"x": 1}, "ec_transfer_params": {"x": 1}, "stream_interval": 2, "mm_payload": "none",
}  # fmt: skip
# Refused by name, each a feature docs/clients.md names (the words that must appear in its "Refused by name" item).
REFUSED = {
    "n": ({"n": 2}, "`n > 1`"),
    "use_beam_search": ({"use_beam_search": True}, "beam search"),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "`tools`"),
    "tool_choice": ({"tool_choice": "required"}, "`tools`"),
    "response_format": ({"response_format": {"type": "json_object"}}, "`response_format`"),
    "structured_outputs": ({"structured_outputs": {"regex": "a+"}}, "structured outputs"),
    "prompt_embeds": ({"prompt_embeds": "AAAA"}, "prompt embeddings"),
    "prompt_logprobs": ({"prompt_logprobs": 1}, "prompt logprobs"),
    "logprob_token_ids": ({"logprobs": True, "logprob_token_ids": [5]}, "`logprob_token_ids`"),
    "echo": ({"echo": True}, "`echo`"),
    "suffix": ({"suffix": "end"}, "`suffix`"),
    "chat_template": ({"chat_template": "{{ messages }}"}, "custom chat templates"),
    "documents": ({"documents": [{"text": "d"}]}, "`documents`"),
    "messages": ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "tool messages"),
}


def request_fields(kind: str) -> set[str]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return set((ChatCompletionRequest if kind == "chat" else CompletionRequest).model_fields)


def parse(kind: str, body: dict):
    base = {"messages": MSG} if kind == "chat" else {"prompt": "hello"}
    return (chat if kind == "chat" else completion)({**base, **body}, Tokenizer(None), LIMITS)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_field_vllm_accepts_is_served_or_refused_by_a_feature_the_readme_names(kind):
    fields = request_fields(kind)
    unknown = fields - SAMPLES.keys() - REFUSED.keys()
    assert not unknown, f"vLLM's {kind} request has fields this audit does not know yet: {sorted(unknown)}"
    accepted = []
    for name in sorted(fields & SAMPLES.keys()):
        body = {name: SAMPLES[name]} if name != "stream_options" else {"stream": True, name: SAMPLES[name]}
        if name in ("logit_bias",):
            body["logprobs"] = None
        if name == "top_logprobs":
            body["logprobs"] = True
        try:
            parse(kind, body)
        except BadRequest as e:
            pytest.fail(f"{kind}.{name}={SAMPLES[name]!r}: vLLM accepts it, the door refused it: {e}")
        accepted.append(name)
    page = (ROOT / "docs" / "clients.md").read_text()
    item = next(item for item in page.split("\n- ") if item.startswith("**Refused by name**"))
    refused_item = " ".join(item.split())
    for name in sorted(fields & REFUSED.keys()):
        body, feature = REFUSED[name]
        if kind == "completion" and name == "messages":
            continue
        with pytest.raises(BadRequest) as e:
            parse(kind, body)
        assert e.value.param and e.value.param.split(".")[0] == name, (name, str(e.value))
        assert feature in refused_item, f"{name} is refused, but docs/clients.md does not name {feature}"
    assert len(accepted) > 40


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_neutral_values_of_refused_features_are_never_errors(kind):
    neutral = {"n": 1, "use_beam_search": False, "tools": None, "tool_choice": "none", "echo": False,
               "response_format": {"type": "text"}, "prompt_logprobs": None, "documents": None,
               "suffix": None}  # fmt: skip
    fields = request_fields(kind)
    for name, value in neutral.items():
        if name in fields:
            parse(kind, {name: value})


def test_text_content_parts_render_as_vllm_renders_them():
    """vLLM's text part types (text, input_text, output_text, refusal, thinking) are joined by newlines for a
    string chat template (vllm/renderers/chat_utils.py); a part whose text is null is skipped."""
    from cluster.requests import messages

    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c", {"type": "text", "text": None}]
    assert messages([{"role": "user", "content": parts}], 100) == [{"role": "user", "content": "a\nb\nc"}]
    with pytest.raises(BadRequest, match="only text parts"):
        messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], 100)


# ------------------------------------------------------------------------------ the tools' own bodies, served
@pytest.fixture(scope="module")
def served():
    ensure_ray()
    with BackgroundServer(config("fields", replicas=1, gateway={"http_port": "any"})) as s:
        s.url = f"http://127.0.0.1:{s.http_port}"
        yield s


def events(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line.removeprefix("data: ")))
    return out


def captured() -> list[tuple[str, str, dict]]:
    """(tool, path, body) of every request body captured from GuideLLM and AIPerf (see the README there)."""
    out = []
    for f in sorted(CLIENTS.glob("*.json")):
        rec = json.loads(f.read_text())
        out.append((f.stem, rec["path"], rec["body"]))
    return out


@pytest.mark.parametrize("tool, path, body", captured(), ids=[c[0] for c in captured()])
def test_guidellm_and_aiperf_bodies_are_served_as_sent(served, tool, path, body):
    body = {**body, "model": "fake"}  # the captured bodies name the model they were sent to
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = events(r)
    assert chunks and all("error" not in ch for ch in chunks), chunks
    text = "".join((ch["choices"][0].get("delta", {}).get("content") or ch["choices"][0].get("text") or "")
                   for ch in chunks if ch["choices"])  # fmt: skip
    assert re.fullmatch(r"( t\d+)+", text), text
    opts = body.get("stream_options") or {}
    if opts.get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(text.split())
    if opts.get("include_usage") and opts.get("continuous_usage_stats"):
        usages = [ch.get("usage") for ch in chunks]
        assert all(usages), "continuous usage stats: every chunk carries the usage so far"
        done = [u["completion_tokens"] for u in usages]
        assert done == sorted(done) and done[-1] == done[-2] == len(text.split())
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_the_usage_in_every_chunk_as_vllm_does(served, path):
    base = {"messages": MSG} if "chat" in path else {"prompt": "hello"}
    body = {**base, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True,
            "continuous_usage_stats": True}}  # fmt: skip
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + path, json=body) as r:
        chunks = events(r)
    done = [ch["usage"]["completion_tokens"] for ch in chunks]
    # vLLM: chat opens with the role chunk (0 tokens); one chunk per token; the closing usage chunk
    assert done == ([0] if "chat" in path else []) + [1, 2, 3, 4, 4], done
    # without include_usage, vLLM sends no usage at all (continuous_usage_stats needs it)
    body["stream_options"] = {"continuous_usage_stats": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + path, json=body) as r:
        assert not [ch for ch in events(r) if ch.get("usage")]
