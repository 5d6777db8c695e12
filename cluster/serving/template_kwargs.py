"""A request's ``chat_template_kwargs`` may hold only the variables the model's chat template reads.

vLLM's serving layer passes a request's ``chat_template_kwargs`` on to ``apply_chat_template``
(vllm/renderers/hf.py ``resolve_chat_template_kwargs``): it refuses only ``chat_template`` and ``tokenize``, and keeps
every key that is a template variable, an argument of the tokenizer's ``apply_chat_template`` or one of
transformers' own (``padding``, ``truncation``, ``max_length``, ``tokenizer_kwargs``, ``return_dict``, ...). So a
client could pad or truncate its own prompt, or set what the renderer binds itself (``messages``, ``tools``, the
tokenizer's special tokens). Here the rule is stricter, and checked at the door before vLLM's app runs: every key
must be a variable the model's template reads, and not one the renderer binds itself; anything else is a 400
naming ``chat_template_kwargs.<key>``.

    TemplateKwargs.of(renderer, chat_template)   once at startup: the model's templates as vLLM resolves them
                                                 (vllm/renderers/hf.py resolve_chat_template: the server's
                                                 --chat-template, else the processor's or the tokenizer's, whose
                                                 own is its chat_template.jinja), with and without tools
    TemplateKwargs.check(path, body)             per request: the places that route's vLLM model reads (CARRIERS)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple

from cluster.serving.requests import BadRequest

FIELD = "chat_template_kwargs"
LISTED = 20  # variables named in a refusal; a template with more says how many it left out


class Carrier(NamedTuple):
    """Where a route's vLLM request model reads ``chat_template_kwargs``: the top-level field of ``model`` (a class
    of vLLM's ``module``). ``chat_only``: only in the route's chat form (a body with ``messages``); its other form's
    model has no such field, and vLLM ignores the key there."""

    module: str
    model: str
    chat_only: bool = False

    def reads(self, body: dict[str, Any]) -> bool:
        return not self.chat_only or "messages" in body


_CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
_RESPONSES = "vllm.entrypoints.openai.responses.protocol"
_ANTHROPIC = "vllm.entrypoints.anthropic.protocol"
# Every POST route of vLLM 0.32's app (as the gateway builds it) whose request model has a chat_template_kwargs
# field (tests/test_template_kwargs.py holds the table against the app). The scale-out render routes answer 403
# unless --enable-scale-out, /v1/systemone 501 without its serving class: their model is checked all the same.
# /inference/v1/generate's reasoning_parser_kwargs.chat_template_kwargs is not checked: its prompt is already token
# ids, and those kwargs (a render server's effective ones, add_generation_prompt included) reach only the replica's
# reasoning parser, never a template.
CARRIERS: dict[str, Carrier] = {
    "/v1/chat/completions": Carrier(_CHAT, "ChatCompletionRequest"),
    "/v1/chat/completions/batch": Carrier(_CHAT, "BatchChatCompletionRequest"),
    "/v1/chat/completions/render": Carrier(_CHAT, "ChatCompletionRequest"),
    "/v1/responses": Carrier(_RESPONSES, "ResponsesRequest"),
    "/v1/responses/render": Carrier(_RESPONSES, "ResponsesRequest"),
    "/v1/messages": Carrier(_ANTHROPIC, "AnthropicMessagesRequest"),
    "/v1/messages/render": Carrier(_ANTHROPIC, "AnthropicMessagesRequest"),
    "/v1/messages/count_tokens": Carrier(_ANTHROPIC, "AnthropicCountTokensRequest"),
    "/tokenize": Carrier("vllm.entrypoints.serve.tokenize.protocol", "TokenizeChatRequest", chat_only=True),
    "/v1/systemone": Carrier("vllm.entrypoints.generate.structured_decisions.protocol", "StructuredDecisionRequest"),
    # SageMaker's door validates the body as a ChatCompletionRequest first, then as a CompletionRequest
    # (vllm/entrypoints/serve/sagemaker/api_router.py invocations, vllm/entrypoints/generate/factories.py)
    "/invocations": Carrier(_CHAT, "ChatCompletionRequest", chat_only=True),
}

# What transformers' renderer takes or binds itself, never a request's variable, whatever a template reads: the
# arguments of apply_chat_template (transformers' tokenization_utils_base.py; the installed signature is added in
# renderer_names), the variables render_jinja_template binds (messages, tools, documents, add_generation_prompt) and
# the globals of its environment (chat_template_utils.py _compile_jinja_template). A template reading `padding` never
# receives it: apply_chat_template takes it as its own argument and pads the tokens.
RENDERER_ARGUMENTS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
    }
)  # fmt: skip


def template_variables(template: str | dict[str, str] | None) -> frozenset[str]:
    """The undeclared variables of a jinja2 chat template (a string, or named templates), parsed by the function
    vLLM filters a request's kwargs with (vllm/renderers/hf.py ``_resolve_chat_template_kwargs``: a sandboxed
    environment with loop controls and the ``{% generation %}`` tag). A template that does not parse reads nothing
    a request may set (vLLM fails every chat with it anyway)."""
    from vllm.renderers.hf import _resolve_chat_template_kwargs

    texts = list(template.values()) if isinstance(template, dict) else [template] if isinstance(template, str) else []
    found: set[str] = set()
    for text in texts:
        try:
            found |= _resolve_chat_template_kwargs(text)
        except Exception:  # jinja2's TemplateSyntaxError; jinja2 is vLLM's dependency, not ours to import
            continue
    return frozenset(found)


def renderer_names(tokenizer: Any) -> frozenset[str]:
    """The names the renderer sets for the template itself: ``RENDERER_ARGUMENTS``, every named argument of
    transformers' ``apply_chat_template`` (as vLLM reads it, vllm/renderers/hf.py _get_hf_base_chat_template_params),
    and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...: transformers binds them, and a request's
    kwargs would override them)."""
    from transformers import PythonBackend

    params = inspect.signature(PythonBackend.apply_chat_template).parameters.values()
    own = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
    special = set(getattr(tokenizer, "special_tokens_map", None) or {})
    return RENDERER_ARGUMENTS | own | special


def model_templates(tokenizer: Any, model_config: Any, chat_template: str | None = None) -> list[str]:
    """The chat templates vLLM may render this model's requests with (vllm/renderers/hf.py resolve_chat_template):
    without tools and with them (a tokenizer with named templates renders tools with its ``tool_use``). A request
    cannot choose another: vLLM refuses a request's own ``chat_template`` (``--trust-request-chat-template`` is
    never set). ``chat_template``: the server's ``--chat-template``, loaded (``OnlineRenderer.chat_template``)."""
    from vllm.renderers.hf import resolve_chat_template

    found = []
    for tools in (None, []):
        text = resolve_chat_template(tokenizer, chat_template, tools, model_config=model_config)
        if isinstance(text, str) and text not in found:
            found.append(text)
    return found


@dataclass(frozen=True)
class TemplateKwargs:
    """What a request's ``chat_template_kwargs`` may hold for one model. Invariant: ``variables`` are the names the
    model's chat templates read (as vLLM resolves them) less ``renderer_names``; computed once, at startup."""

    variables: frozenset[str]

    @classmethod
    def of(cls, renderer: Any, chat_template: str | None = None) -> TemplateKwargs:
        """From vLLM's renderer in the gateway (``RemoteEngineClient.renderer``, the same object as
        ``app.state.online_renderer.renderer``) and the server's loaded ``--chat-template`` if any
        (``app.state.online_renderer.chat_template``)."""
        tokenizer = renderer.get_tokenizer()
        templates = model_templates(tokenizer, renderer.model_config, chat_template)
        read = frozenset().union(*map(template_variables, templates))
        return cls(read - renderer_names(tokenizer))

    def check(self, path: str, body: Any) -> None:
        """The request's keys, refused as ``check_template_kwargs`` refuses them."""
        check_template_kwargs(body, self.variables, path)


def check_template_kwargs(body: Any, variables: frozenset[str], path: str) -> None:
    """Raise ``BadRequest`` unless every key of the ``chat_template_kwargs`` that ``path``'s vLLM model reads from
    ``body`` (the parsed JSON) is one of ``variables``. A ``null`` field, a route whose model has no such field and a
    body that is not an object pass (vLLM's own checks answer the rest)."""
    carrier = CARRIERS.get(path)
    if carrier is None or not isinstance(body, dict) or not carrier.reads(body):
        return
    kwargs = body.get(FIELD)
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        got = _json_type(kwargs)
        raise BadRequest(f"{FIELD}: expected an object of the chat template's variables, got {got}", FIELD)
    for key in kwargs:
        if key not in variables:
            where = f"{FIELD}.{key}"
            own = " (an argument of the chat template's renderer)" if key in RENDERER_ARGUMENTS else ""
            message = f"{where}: {key!r} is not a variable of the model's chat template{own}; {_reads(variables)}"
            raise BadRequest(message, where)


def _reads(variables: frozenset[str]) -> str:
    if not variables:
        return "the template reads no variable a request may set"
    names = sorted(variables)
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return f"the template reads {', '.join(names[:LISTED])}{more}"


def _json_type(value: Any) -> str:
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return kinds.get(type(value), type(value).__name__)
