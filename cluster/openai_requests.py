"""OpenAI-compatible requests at the HTTP door: a JSON body goes through the request model both doors share
(cluster/requests.py: vLLM's own protocol models and SamplingParams, the same refusals and limits) and becomes
the gateway's ``ValidRequest``. The door's own parts are the JSON itself, the model name (404 for another
model), streaming options, and the ``"vtoken": {...}`` extension field (a request's eviction options).

Served: every sampling field vLLM serves (through ``to_sampling_params``), logprobs (chat: logprobs +
top_logprobs; completions: logprobs=k), stream with stream_options (include_usage, continuous_usage_stats),
text messages (system, developer, user, assistant) through the model's chat template, a prompt as text or token
ids. Refused by name,
because they would change the answer in ways the doors do not carry: n > 1, beam search, tools, structured
outputs, prompt embeddings and non-text content, prompt logprobs and echo, custom chat templates
(``requests.UNSERVED``). Informational fields (user, metadata, service_tier, ...) and unknown fields are
ignored, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from cluster.config import ServeConfig
from cluster.requests import (
    EXTENSION,
    GUIDE,
    UNSERVED,
    BadRequest,
    Limits,
    Parsed,
    ValidRequest,
    chat,
    chat_ids,
    completion,
    messages,
    prompt_ids,
    protocol_model,
    vtoken_options,
)
from vtoken.prefix_hash import prefix_hashes


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
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage per chunk


def load_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; anything else, however malformed or deeply nested, is a BadRequest."""
    return _object(raw, "the body")


def _object(raw: bytes, what: str) -> dict[str, Any]:
    def no_constant(name: str):
        raise BadRequest(f"malformed JSON: {name} is not a number JSON allows")

    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    except RecursionError:  # Python's parser recurses once per nesting level
        raise BadRequest("malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(body).__name__}")
    return body


def limits(cfg: ServeConfig) -> Limits:
    return Limits(cfg.engine.max_model_len, cfg.gateway.max_prompt_chars, cfg.max_logprobs)


def check_model(model: str | None, cfg: ServeConfig) -> None:
    if model is not None and model not in (cfg.model_name, cfg.model):
        raise ModelNotFound(model, cfg.model_name)


def chat_request(body: dict[str, Any], cfg: ServeConfig, tokenizer) -> OpenAIRequest:
    options = body.pop(EXTENSION, None)
    check_model(body.get("model") if isinstance(body.get("model"), str) else None, cfg)
    parsed = chat(body, tokenizer, limits(cfg))
    return _request(parsed, bool(parsed.request.logprobs), options, cfg)


def completion_request(body: dict[str, Any], cfg: ServeConfig, tokenizer) -> OpenAIRequest:
    options = body.pop(EXTENSION, None)
    check_model(body.get("model") if isinstance(body.get("model"), str) else None, cfg)
    parsed = completion(body, tokenizer, limits(cfg))
    return _request(parsed, parsed.request.logprobs is not None, options, cfg)


def _request(parsed: Parsed, logprobs: bool, options: Any, cfg: ServeConfig) -> OpenAIRequest:
    req = parsed.request
    eviction = vtoken_options(options, cfg.vtoken)
    valid = ValidRequest(request_id="", prompt_token_ids=parsed.prompt_token_ids, sampling=parsed.sampling,
                         eviction=eviction,
                         prefix_hashes=prefix_hashes(parsed.prompt_token_ids, cfg.engine.block_size))  # fmt: skip
    # vLLM's should_include_usage (vllm/entrypoints/serve/utils/api_utils.py): continuous usage needs include_usage.
    opts = req.stream_options if req.stream else None
    usage = bool(opts and opts.include_usage)
    return OpenAIRequest(valid, bool(req.stream), usage, logprobs, usage and bool(opts.continuous_usage_stats))


def tokenize_response(kind: str, body: dict[str, Any], cfg: ServeConfig, tokenizer) -> dict[str, Any]:
    """vLLM's /tokenize and /detokenize (vllm/entrypoints/serve/tokenize/serving.py OpenAIServingTokenization):
    the same request and response models, the prompt or messages rendered as for generation."""
    from vllm.entrypoints.serve.tokenize.protocol import (
        DetokenizeRequest,
        DetokenizeResponse,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
        TokenizeResponse,
    )

    check_model(body.get("model") if isinstance(body.get("model"), str) else None, cfg)
    max_chars = cfg.gateway.max_prompt_chars
    if kind == "detokenize":
        req = protocol_model(DetokenizeRequest, body)
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens)).model_dump(mode="json")
    if "messages" in body:
        msgs = messages(body.get("messages"), max_chars)
        req = protocol_model(TokenizeChatRequest, {**body, "messages": msgs})
        for name in ("chat_template", "tools"):
            if getattr(req, name):
                raise BadRequest(f"{name}: {UNSERVED[name]} ({GUIDE})", name)
        ids = chat_ids(req, msgs, tokenizer)
    else:
        req = protocol_model(TokenizeCompletionRequest, body)
        ids = prompt_ids(req.prompt, tokenizer, max_chars, req.add_special_tokens)
    strs = tokenizer.token_strs(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=cfg.engine.max_model_len, tokens=ids,
                            token_strs=strs).model_dump(mode="json")  # fmt: skip
