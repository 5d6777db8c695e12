"""OpenAI-compatible requests at the HTTP door: a JSON body is validated with vLLM's own protocol models
(``ChatCompletionRequest``, ``CompletionRequest``), then turned into the gateway's ``ValidRequest`` through the
checks the gRPC door uses (``Sampling``, the context length, ``vtoken_options`` for the ``"vtoken": {...}``
extension field). Every refusal is a ``BadRequest`` naming the field (HTTP 400) or ``ModelNotFound`` (404).

Served: n=1, max_tokens / max_completion_tokens, temperature, top_p, top_k, stop, seed, presence and frequency
penalties, ignore_eos, logprobs (chat: logprobs + top_logprobs; completions: logprobs=k), stream with
stream_options.include_usage; text messages (system, developer, user, assistant) through the model's chat
template. Refused by name rather than ignored, because ignoring them would change the answer: n > 1, tools,
response_format, structured outputs, logit_bias, echo, beam search, prompt logprobs, custom chat templates,
non-text content. Informational fields (user, metadata, service_tier, ...) and unknown fields are ignored,
as vLLM does.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any, NamedTuple

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMClientError

from cluster.config import ServeConfig
from cluster.requests import BadRequest, ValidRequest, check_length, sampling, vtoken_options

EXTENSION = "vtoken"  # extra_body={"vtoken": {...}}: the request's own eviction options
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields whose effect we serve; anything else a client sets to other than its default is refused by name,
# except these, which change nothing about the answer.
SERVED = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k",
    "stop", "seed", "presence_penalty", "frequency_penalty", "ignore_eos", "logprobs", "top_logprobs", "stream",
    "stream_options",
}  # fmt: skip
IGNORED = {
    "user", "request_id", "session_id", "priority", "parallel_tool_calls", "tool_choice", "include_reasoning",
    "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens", "add_generation_prompt",
    "return_token_ids", "return_tokens_as_token_ids", "stream_interval", "cache_salt", "service_tier",
}  # fmt: skip


class ModelNotFound(LookupError):
    """The request names a model this deployment does not serve (HTTP 404)."""

    def __init__(self, model: str, served: str):
        super().__init__(f"The model `{model}` does not exist; this server serves `{served}` (GET /v1/models)")


class OpenAIRequest(NamedTuple):
    """A validated request: what the dispatcher runs, and what the response needs to know."""

    valid: ValidRequest
    stream: bool
    include_usage: bool
    logprobs: bool  # the client asked for log-probabilities


def load_json(raw: bytes) -> dict[str, Any]:
    def no_constant(name: str):
        raise BadRequest(f"malformed JSON: {name} is not a number JSON allows")

    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def chat_request(body: dict[str, Any], cfg: ServeConfig, tokenizer) -> OpenAIRequest:
    options = body.pop(EXTENSION, None)
    messages = _messages(body.get("messages"), cfg.gateway.max_prompt_chars)
    req = _model(ChatCompletionRequest, body)
    _check_model(req.model, cfg)
    _refuse_unserved(req)
    ids = tokenizer.encode_chat(messages)
    field, max_tokens = _max_tokens(req)
    if max_tokens is None:  # OpenAI's (and vLLM's) default for chat: whatever the context leaves
        max_tokens = max(cfg.engine.max_model_len - len(ids), 1)
    top = (req.top_logprobs or 0) if req.logprobs else None
    return _valid(req, ids, field, max_tokens, top, options, cfg)


def completion_request(body: dict[str, Any], cfg: ServeConfig, tokenizer) -> OpenAIRequest:
    options = body.pop(EXTENSION, None)
    req = _model(CompletionRequest, body)
    _check_model(req.model, cfg)
    _refuse_unserved(req)
    ids = _prompt_ids(req.prompt, tokenizer, cfg.gateway.max_prompt_chars)
    field, max_tokens = _max_tokens(req)
    if max_tokens is None:
        max_tokens = max(cfg.engine.max_model_len - len(ids), 1)
    return _valid(req, ids, field, max_tokens, req.logprobs, options, cfg)


# ---------------------------------------------------------------------------------------------- pieces
def _model(cls, body: dict[str, Any]):
    try:
        with warnings.catch_warnings():  # max_tokens is deprecated in vLLM's chat model, not in OpenAI's API
            warnings.simplefilter("ignore", DeprecationWarning)
            return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or _is_field(p))
        msg = err["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{loc}: {msg}" if loc else msg, loc or None) from None
    except (VLLMClientError, ValueError) as e:  # vLLM's own checks in its validators (VLLMValidationError)
        param = getattr(e, "parameter", None)
        msg = str(e.args[0] if e.args else e).splitlines()[0]
        raise BadRequest(f"{param}: {msg}" if param else msg, param) from None


def _is_field(part: Any) -> bool:
    """A loc part that names a field, not a union branch pydantic tried (``str``, ``ChatCompletion...``)."""
    return isinstance(part, str) and part.isidentifier() and part.islower() and part not in {"str", "int", "list"}


def _check_model(model: str | None, cfg: ServeConfig) -> None:
    if model is not None and model not in (cfg.model_name, cfg.model):
        raise ModelNotFound(model, cfg.model_name)


def _refuse_unserved(req) -> None:
    for name in sorted(req.model_fields_set - SERVED - IGNORED):
        info = type(req).model_fields.get(name)
        if info is None:
            continue  # an unknown field: vLLM ignores those too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            value, default = getattr(req, name), info.get_default(call_default_factory=True)
        if value != default and value not in (None, [], {}):
            raise BadRequest(f"{name}: not supported by vtoken serve (README: Use it from the OpenAI client)", name)
    if (req.n or 1) != 1:
        raise BadRequest(f"n: only n=1 is supported, got {req.n}", "n")
    opts = req.stream_options
    if opts is not None and opts.continuous_usage_stats:
        raise BadRequest("stream_options.continuous_usage_stats: not supported", "stream_options")


def _messages(raw: Any, max_chars: int) -> list[dict[str, str]]:
    """Text messages for the chat template; the roles and content parts we do not serve are refused."""
    if not isinstance(raw, list):
        raise BadRequest("messages: expected a list of messages", "messages")
    if not raw:
        raise BadRequest("messages: must not be empty", "messages")
    out, chars = [], 0
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise BadRequest(f"{where}: expected an object with role and content", where)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role: {role!r} is not served; roles: {', '.join(ROLES)} (no tools)", f"{where}.role"
            )
        if m.get("tool_calls"):
            raise BadRequest(f"{where}.tool_calls: tools are not supported", f"{where}.tool_calls")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):  # fmt: skip
                raise BadRequest(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content: expected a string or text parts", f"{where}.content")
        if not content.strip():
            raise BadRequest(f"{where}.content: must not be empty", f"{where}.content")
        chars += len(content)
        out.append({"role": ROLES[role], "content": content})
    if chars > max_chars:
        raise BadRequest(f"messages: {chars} characters; the limit is {max_chars}", "messages")
    return out


def _prompt_ids(prompt: Any, tokenizer, max_chars: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # token ids, as vLLM accepts them
    if isinstance(prompt, list):
        raise BadRequest("prompt: one prompt per request (a string or token ids), not a batch", "prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("prompt: must not be empty", "prompt")
    if len(prompt) > max_chars:
        raise BadRequest(f"prompt: {len(prompt)} characters; the limit is {max_chars}", "prompt")
    return tokenizer.encode(prompt)


def _max_tokens(req) -> tuple[str, int | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        given = getattr(req, "max_completion_tokens", None)
        field = "max_completion_tokens" if given is not None else "max_tokens"
        value = given if given is not None else req.max_tokens
    if value is not None and value < 1:
        raise BadRequest(f"{field}: must be at least 1, got {value}", field)
    return field, value


def _valid(req, ids, field, max_tokens, top, options, cfg: ServeConfig) -> OpenAIRequest:
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"{name}: must be a finite number", name)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    given = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "logprobs": top,
    }
    fields = {k: v for k, v in given.items() if v is not None}
    s = sampling({**fields, "max_tokens": max_tokens, "stop": stop, "ignore_eos": req.ignore_eos})
    check_length(len(ids), s.max_tokens, cfg.engine.max_model_len, field)
    eviction = vtoken_options(options, cfg.vtoken)
    valid = ValidRequest(request_id="", prompt_token_ids=ids, sampling=s, eviction=eviction)
    usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return OpenAIRequest(valid, bool(req.stream), usage, top is not None)
