"""A request's work, counted at the door before vLLM's serving layer builds anything for it, and checked again exactly
once its prompts are rendered.

vLLM's serving layer trusts its one engine: ``n`` up to 16,384, a list of 1,024 prompts, and lists of ``n`` x prompts
built before the first output. A shared gateway cannot: one admission slot would buy unbounded work. So each
request is weighed by the tokens it can make the fleet hold, ``n`` x prompts x (prompt + max tokens), as a router
weighs requests by their cost rather than their count:

    ceiling    ``n`` (and ``best_of``) over ``gateway.max_n`` (128, OpenAI's own cap), or ``n`` x prompts x max tokens
               (each sequence at least one KV block) over ``gateway.max_request_tokens``: a 400 naming the field,
               before vLLM allocates anything
    admission  the requests in flight over both doors hold at most ``gateway.max_inflight_tokens`` of work (beyond,
               429; a request alone is always admitted). At the door the prompt's tokens are not known yet: the
               body's size bounds them (a token is at least one byte of its text, and a token id two bytes of JSON)
    exact      once rendered (cluster/serving/remote_engine.py), the request's prompts add up their real lengths against
               ``max_request_tokens`` (``WorkTally``), a 400 naming ``max_tokens`` past it

Routes that only render or tokenize (``/tokenize``, ``/detokenize``, Anthropic's ``count_tokens``, the ``render``
routes) are admitted too, weighed by their body's size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cluster.serving.requests import BadRequest

# vLLM's routes that render or tokenize without generating: admitted like generation, weighed by their size
RENDER = frozenset({"/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/messages/render",
                    "/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render",
                    "/v1/chat/completions/derender", "/v1/completions/derender", "/cohere/v2/chat/render"})  # fmt: skip
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class Work(NamedTuple):
    """What a request asks for, as read from its body: ``tokens`` its admission weight."""

    tokens: int
    n: int = 1
    prompts: int = 1
    max_tokens: int = 0


def _int(body: dict, key: str) -> int | None:
    v = body.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def prompt_count(path: str, body: dict) -> int:
    """How many prompts the request holds (a completion's list of prompts, a batch's conversations), else 1."""
    if path.endswith("/chat/completions/batch"):
        msgs = body.get("messages")
        return len(msgs) if isinstance(msgs, list) else 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def request_work(path: str, body: Any, size: int, g: Any, max_model_len: int, block_size: int = 1) -> Work:
    """The request's work as its body states it; BadRequest naming the field over a per-request ceiling. A body
    that is not a JSON object weighs its size (vLLM's own checks refuse it). Each sequence counts at least one KV
    block (``block_size`` tokens): it holds one in its replica however few tokens it asks for, and a request of
    many tiny sequences (``n`` x 1,024 prompts of one token) costs the gateway per sequence, not per token."""
    if path in RENDER or not isinstance(body, dict):
        return Work(tokens=max(size, 1))
    sampling = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else body
    for key in ("n", "best_of"):
        v = _int(sampling, key)
        if v is not None and v > g.max_n:
            raise BadRequest(f"{key}: at most {g.max_n} (gateway.max_n), got {v}", key)
    n = max(_int(sampling, "n") or 1, _int(sampling, "best_of") or 1, 1)
    field, max_tokens = "max_tokens", None
    for key in MAX_TOKENS_FIELDS:
        if (v := _int(sampling, key)) is not None:
            field, max_tokens = key, v
            break
    # no max tokens: the context's length bounds them (vLLM's own default for chat)
    max_tokens = max(min(max_tokens, max_model_len), 0) if max_tokens is not None else max_model_len
    prompts = prompt_count(path, body)
    generated = n * prompts * max(max_tokens, block_size)
    if generated > g.max_request_tokens:
        where = field if _int(sampling, field) is not None else "n" if n > 1 else "max_tokens"
        raise BadRequest(
            f"{where}: n ({n}) x prompts ({prompts}) x max tokens ({max_tokens}, at least a block of {block_size}) = "
            f"{generated} tokens, over gateway.max_request_tokens ({g.max_request_tokens}); ask for fewer",
            where,
        )
    return Work(tokens=n * size + generated, n=n, prompts=prompts, max_tokens=max_tokens)


class WorkTally:
    """A request's work as its prompts are rendered (one ``add`` per prompt that reaches the engine client):
    BadRequest naming ``max_tokens`` once the sum of ``n`` x (prompt + max tokens) passes ``limit``."""

    def __init__(self, limit: int, block_size: int = 1):
        self.limit, self.block_size, self.tokens = limit, block_size, 0

    def add(self, n: int, prompt_tokens: int, max_tokens: int) -> None:
        self.tokens += n * max(prompt_tokens + max_tokens, self.block_size)
        if self.tokens > self.limit:
            raise BadRequest(
                f"max_tokens: this request's prompts and the tokens it asks for come to over {self.limit} tokens "
                f"(n x (prompt + max tokens), summed over its prompts; gateway.max_request_tokens)",
                "max_tokens",
            )
