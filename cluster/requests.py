"""The one request model both front doors share. A door turns its wire format into OpenAI's JSON shape (HTTP
takes the body as sent: cluster/openai_requests.py; gRPC maps its protobuf onto the same field names:
cluster/grpc_requests.py); from there everything is done once, here, the way vLLM's own server does it:

    body --vLLM's protocol model--> CompletionRequest | ChatCompletionRequest   (vLLM validates every field)
         --refuse_unserved-->       only what cannot work through the doors is refused, by name
         --to_sampling_params-->    vLLM's own mapping to SamplingParams         (vLLM validates the values)
         --prompt_ids / messages--> token ids, the context length checked

Every sampling field vLLM honours is honoured (repetition_penalty, min_p, min_tokens, stop_token_ids, logit_bias,
bad_words, include_stop_str_in_output, skip_special_tokens, ...): they cross to the replica as the non-default
fields of ``vllm.SamplingParams`` (``sampling_kwargs``) and the replica rebuilds the same object. Every refusal is
a ``BadRequest`` (gRPC INVALID_ARGUMENT, HTTP 400) with one line naming the field (``param``). Nothing here
touches Ray or the engine.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError
from vllm.exceptions import VLLMClientError

from vtoken.config import REQUEST_KEYS, VTokenConfig, request_args

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
EXTENSION = "vtoken"  # the request's own eviction options: HTTP extra_body={"vtoken": {...}}, gRPC VTokenOptions
# Refused by name: each would change the answer or its shape in ways the doors do not carry. Anything else a
# client sends is either honoured (sampling) or, like vLLM's own server does for informational fields, ignored.
UNSERVED = {
    "use_beam_search": "beam search is not served by vtoken serve",
    "tools": "tools are not supported",
    "functions": "tools are not supported",
    "response_format": "structured outputs are not supported",
    "structured_outputs": "structured outputs are not supported",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "prompt_logprobs": "prompt log-probabilities are not returned by vtoken serve",
    "logprob_token_ids": "log-probabilities of chosen token ids are not returned by vtoken serve",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "chat_template": "custom chat templates are not accepted; the model's own template renders messages",
    "documents": "documents for the chat template are not supported",
}
GUIDE = "docs/clients.md: OpenAI API"


class BadRequest(ValueError):
    """The request cannot be served as sent; ``param`` names the field at fault when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Limits(NamedTuple):
    max_model_len: int
    max_prompt_chars: int
    # vLLM's max_logprobs (ModelConfig, --max-logprobs; 20 by default, -1: the vocabulary): more log-probabilities
    # than this a request may not ask, as vLLM's server refuses them (SamplingParams._validate_logprobs).
    max_logprobs: int = 20


class Parsed(NamedTuple):
    """A request checked as far as both doors go alike."""

    request: Any  # vLLM's CompletionRequest or ChatCompletionRequest
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # non-default fields of vllm.SamplingParams (see sampling_kwargs)


# ---------------------------------------------------------------------------------------------- the model
def protocol_model(cls, body: dict[str, Any]):
    """``cls.model_validate(body)`` for one of vLLM's own protocol models (``"chat"`` and ``"completion"`` name
    ChatCompletionRequest and CompletionRequest); its validation errors become BadRequest naming the field."""
    if cls in ("chat", "completion"):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        cls = ChatCompletionRequest if cls == "chat" else CompletionRequest
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
        raise _bad(e) from None
    except Exception as e:  # noqa: BLE001 - a validator of vLLM's that trips over the body's shape is still the
        # body's fault: {"structured_outputs": true} raised AttributeError in vLLM's CompletionRequest validator
        raise BadRequest(f"the request does not fit vLLM's {cls.__name__}: {type(e).__name__}: {e}") from None


def _bad(e: Exception) -> BadRequest:
    param = getattr(e, "parameter", None)
    msg = str(e.args[0] if e.args else e).splitlines()[0]
    return BadRequest(f"{param}: {msg}" if param and not msg.startswith(param) else msg, param)


def _is_field(part: Any) -> bool:
    """A loc part that names a field, not a union branch pydantic tried (``str``, ``ChatCompletion...``)."""
    return isinstance(part, str) and part.isidentifier() and part.islower() and part not in {"str", "int", "list"}


def neutral(name: str, value: Any) -> bool:
    """A value that asks for nothing: absent, empty, false, or ``response_format: {"type": "text"}`` (plain text
    is what every answer is)."""
    if value in (None, False, [], {}, ""):
        return True
    if name == "response_format":
        return getattr(value, "type", None) == "text" and getattr(value, "json_schema", None) is None
    return False


def refuse_unserved(req) -> None:
    """Refuse, by name, what cannot work through the doors; a neutral value of any field is never an error."""
    for name, why in UNSERVED.items():
        if not neutral(name, getattr(req, name, None)):
            raise BadRequest(f"{name}: {why} ({GUIDE})", name)
    if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
        raise BadRequest(f"tool_choice: tools are not supported ({GUIDE})", "tool_choice")
    if (req.n or 1) != 1:
        raise BadRequest(f"n: only n=1 is supported, got {req.n}", "n")
    if EXTENSION in (req.vllm_xargs or {}):
        raise BadRequest("vllm_xargs.vtoken: set eviction options in the request's own `vtoken` field", "vllm_xargs")


# ---------------------------------------------------------------------------------------------- sampling
@functools.cache
def _neutral():
    from vllm import SamplingParams

    return SamplingParams.from_optional()


@functools.cache
def _sampling_fields() -> tuple[str, ...]:
    """The arguments of ``SamplingParams.from_optional`` a request can set (how the replica rebuilds them)."""
    import inspect

    from vllm import SamplingParams

    skip = {"output_kind", "skip_clone"}  # the replica streams deltas; a fresh object needs no clone
    return tuple(k for k in inspect.signature(SamplingParams.from_optional).parameters if k not in skip)


def sampling_kwargs(params) -> dict[str, Any]:
    """The fields of a ``vllm.SamplingParams`` that differ from its neutral values: a small picklable dict from
    which ``SamplingParams.from_optional(**kwargs)`` rebuilds an equal object (tests/test_requests.py)."""
    neutral, empty = _neutral(), (None, [], {})  # an empty list or mapping means what None means
    out = {}
    for k in _sampling_fields():
        v, n = getattr(params, k), getattr(neutral, k)
        if v != n and not (v in empty and n in empty):
            out[k] = v
    return out


def sampling(req, max_tokens: int, defaults: dict[str, Any]) -> dict[str, Any]:
    """vLLM's mapping of a protocol request to SamplingParams (``to_sampling_params``, with the model's
    generation defaults, as ``vllm serve`` applies them), as ``sampling_kwargs``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            params = req.to_sampling_params(max_tokens, dict(defaults))
    except (VLLMClientError, ValueError, TypeError, OverflowError) as e:
        raise _bad(e) from None
    return sampling_kwargs(params)


def generation_defaults(folder: str | None) -> dict[str, Any]:
    """The model's own sampling defaults from its ``generation_config.json``, as vLLM's server reads them
    (vllm/config/model.py ModelConfig.get_diff_sampling_param, ``--generation-config auto``)."""
    path = Path(folder or "") / "generation_config.json"
    if folder is None or not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    keys = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p")
    out = {k: raw[k] for k in keys if raw.get(k) is not None}
    if raw.get("max_new_tokens") is not None:
        out["max_tokens"] = raw["max_new_tokens"]
    return out


# ---------------------------------------------------------------------------------------------- prompts
def messages(raw: Any, max_chars: int) -> list[dict[str, str]]:
    """Text messages for the chat template, for both doors; the roles and content parts we do not serve are
    refused. ``developer`` is OpenAI's newer name for ``system``."""
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
        if isinstance(content, list):  # content parts: text only (no images, audio, files)
            content = _text_parts(content, where)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content: expected a string or text parts", f"{where}.content")
        chars += len(content)  # an empty message is a message, as vLLM takes it: the template renders its turn
        out.append({"role": ROLES[role], "content": content})
    if chars > max_chars:
        raise BadRequest(f"messages: {chars} characters; the limit is {max_chars}", "messages")
    return out


# vLLM's text content parts and where each keeps its text (vllm/renderers/chat_utils.py TEXT_PART_TYPES).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def _text_parts(parts: list, where: str) -> str:
    """A message's content parts as vLLM renders text-only content for a string chat template: the texts joined
    by newlines, a part whose text is null skipped, a bare string taken as text. Anything else (images, audio,
    files) is refused."""
    texts = []
    for p in parts:
        if isinstance(p, str):
            texts.append(p)
            continue
        key = TEXT_PARTS.get(p.get("type", "text")) if isinstance(p, dict) else None
        if key is None or not isinstance(p.get(key), str | None):
            raise BadRequest(f"{where}.content: only text parts are supported", f"{where}.content")
        if p.get(key) is not None:
            texts.append(p[key])
    return "\n".join(texts)


def prompt_ids(prompt: Any, tokenizer: Tokenizer, max_chars: int, add_special_tokens: bool = True) -> list[int]:
    """One completion prompt: a string, or token ids as vLLM accepts them; a batch of one is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):
        raise BadRequest("prompt: one prompt per request (a string or token ids), not a batch", "prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("prompt: must not be empty", "prompt")
    if len(prompt) > max_chars:
        raise BadRequest(f"prompt: {len(prompt)} characters; the limit is {max_chars}", "prompt")
    return tokenizer.encode(prompt, add_special_tokens)


def _truncate(ids: list[int], req, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens`` (-1: the model's context) and ``truncation_side`` (left by default)."""
    k = req.truncate_prompt_tokens
    if k is None or len(ids) <= (k if k >= 0 else max_model_len):
        return ids
    k = max_model_len if k < 0 else k
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k :]


def check_length(n_prompt: int, max_tokens: int, max_model_len: int, field: str = "max_tokens") -> None:
    if n_prompt + max_tokens > max_model_len:
        raise BadRequest(
            f"prompt ({n_prompt} tokens) + {field} ({max_tokens}) exceeds the model's context of {max_model_len} "
            "tokens",
            field,
        )


def completion(body: dict[str, Any], tokenizer: Tokenizer, limits: Limits) -> Parsed:
    """A completion request in OpenAI's JSON shape, checked as far as both doors go alike."""
    req = protocol_model("completion", body)
    refuse_unserved(req)
    ids = _truncate(prompt_ids(req.prompt, tokenizer, limits.max_prompt_chars, req.add_special_tokens), req,
                    limits.max_model_len)  # fmt: skip
    return _parsed(req, ids, req.max_tokens, "max_tokens", limits, tokenizer.defaults)


def chat(body: dict[str, Any], tokenizer: Tokenizer, limits: Limits) -> Parsed:
    """A chat request in OpenAI's JSON shape; its messages are rendered with the model's chat template."""
    msgs = messages(body.get("messages"), limits.max_prompt_chars)
    req = protocol_model("chat", {**body, "messages": msgs})
    refuse_unserved(req)
    ids = _truncate(chat_ids(req, msgs, tokenizer), req, limits.max_model_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        given = req.max_completion_tokens
        field, value = ("max_completion_tokens", given) if given is not None else ("max_tokens", req.max_tokens)
    return _parsed(req, ids, value, field, limits, tokenizer.defaults)


def chat_ids(req, msgs: list[dict[str, str]], tokenizer: Tokenizer) -> list[int]:
    """Messages rendered with the model's chat template as the request asks (a chat or a /tokenize request)."""
    kwargs = template_kwargs(req.chat_template_kwargs, tokenizer)
    return tokenizer.encode_chat(msgs, req.add_generation_prompt, req.continue_final_message, req.add_special_tokens,
                                 kwargs)  # fmt: skip


def template_kwargs(kwargs: dict[str, Any] | None, tokenizer: Tokenizer) -> dict[str, Any]:
    """``chat_template_kwargs`` as vLLM filters them (vllm/renderers/hf.py resolve_chat_template_kwargs), stricter:
    only variables the model's own template reads are passed to it. An argument of ``apply_chat_template`` itself
    (``chat_template``, ``tokenize``, ``tools``, ``documents``, ``messages``, ...) is refused by name: the template is
    the model's, and the request's own fields say the rest. Anything else the template does not read is dropped,
    as vLLM drops it."""
    if not kwargs:
        return {}
    reserved = tokenizer.template_arguments()
    for name in kwargs:
        if name in reserved:
            where = f"chat_template_kwargs.{name}"
            raise BadRequest(
                f"{where}: {name!r} is an argument of the chat template's renderer, not a template variable; the "
                "model's own template renders the messages (custom templates, tools and documents are not accepted "
                "through chat_template_kwargs)",
                where,
            )
    reads = tokenizer.template_variables()
    return {k: v for k, v in kwargs.items() if k in reads}


def _parsed(req, ids, max_tokens, field, limits: Limits, defaults: dict[str, Any]) -> Parsed:
    if max_tokens is None:  # OpenAI's (and vLLM's) default: whatever the context leaves, within the model's own
        max_tokens = max(limits.max_model_len - len(ids), 1)
        max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
    try:
        s = sampling(req, max_tokens, defaults)
    except BadRequest as e:  # vLLM names max_tokens whichever field the client used
        if e.param != "max_tokens" or field == "max_tokens":
            raise
        raise BadRequest(str(e).replace("max_tokens", field), field) from None
    check_length(len(ids), max_tokens, limits.max_model_len, field)
    check_logprobs(s, limits.max_logprobs, "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs")
    return Parsed(req, ids, s)


def check_logprobs(sampling: dict[str, Any], most: int, field: str) -> None:
    """vLLM's bound on log-probabilities (SamplingParams._validate_logprobs), at the door as at vLLM's server."""
    if most < 0:  # -1: as many as the vocabulary has (the engine checks)
        return
    for key, name in (("logprobs", field), ("prompt_logprobs", "prompt_logprobs")):
        n = sampling.get(key)
        if n is not None and n > most:
            raise BadRequest(f"{name}: requested {n} log-probabilities, more than max_logprobs ({most})", name)


# ---------------------------------------------------------------------------------------------- eviction
class Eviction(NamedTuple):
    """A request's own eviction options as checked: ``extra_args`` for ``SamplingParams`` (None when it chose
    none) and ``config``, the served VTokenConfig with them applied (its budget bounds the request's blocks)."""

    extra_args: dict[str, Any] | None
    config: VTokenConfig


def vtoken_options(options: Any, served: dict[str, Any]) -> Eviction:
    """The one check of a request's eviction options, for both doors (gRPC ``VTokenOptions``, HTTP's
    ``"vtoken": {...}``): a mapping of ``request_args`` keys (policy, budget, interval, sink, recent, seed,
    policy_params, prefill_evict, prefill_window, evict, pressure_floor) that ``request_args`` accepts and that the
    served config accepts too (``VTokenConfig.for_request``: e.g. h2o on an engine that collects no attention scores
    is refused). What passes is exactly what the engine will accept; refusals are BadRequest naming vtoken.<key>."""
    cfg = VTokenConfig(**served)
    if options is None or options == {}:
        return Eviction(None, cfg)
    if not isinstance(options, dict):
        raise BadRequest(f"vtoken: expected an object of eviction options, got {type(options).__name__}", "vtoken")
    if not cfg.enabled:
        raise BadRequest(
            "vtoken: this deployment serves with eviction off (vtoken.mode: off); per-request eviction options "
            "need vtoken.mode: vtoken or naive",
            "vtoken",
        )
    for key, value in options.items():
        if key not in REQUEST_KEYS:
            raise BadRequest(
                f"vtoken.{key}: not a per-request option; a request may set {', '.join(sorted(REQUEST_KEYS))}",
                f"vtoken.{key}",
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"vtoken.{key}: must be a finite number, got {value}", f"vtoken.{key}")
    try:
        extra = request_args(**options)
        effective = cfg.for_request(options)
    except ValidationError as e:
        named = [_option_error(".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")) for err in
                 e.errors()]  # fmt: skip
        raise BadRequest("; ".join(f"{w}: {m}" for w, m in named), named[0][0]) from None
    except (ValueError, TypeError, OverflowError) as e:  # the policy's own checks, its parameters; option pairs
        where, msg = _option_error("", str(e).splitlines()[0])
        raise BadRequest(f"{where}: {msg}", where) from None
    return Eviction(extra, effective)


def _option_error(loc: str, msg: str) -> tuple[str, str]:
    """(the ``vtoken.*`` field at fault, the reason) of an option error: pydantic's ``loc`` where it has one, else
    the option a message starts with (``policy_params.history: must be a whole number``, ``pressure_floor: ...``)."""
    if not loc:
        head, _, rest = msg.partition(": ")
        if head.split(".")[0] in REQUEST_KEYS and rest:
            loc, msg = head, rest
        elif "policy" in msg:
            loc = "policy"
    return ("vtoken." + loc if loc else "vtoken"), msg


class ValidRequest(BaseModel):
    """A request either door has validated: what the dispatcher places and the engine runs."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    request_id: str  # the client's (gRPC request_id; empty over HTTP); engines know the gateway's own id
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # non-default vllm.SamplingParams fields (sampling_kwargs), max_tokens among them
    deadline_s: float | None = None
    eviction: Eviction | None = None  # the request's own eviction options, checked (vtoken_options)
    # The prompt's block hashes (vtoken/prefix_hash.py), computed in the parse worker: placement matches them against
    # the replicas' prefix caches. Empty: placement weighs no prefix.
    prefix_hashes: tuple[int, ...] = ()

    @property
    def max_tokens(self) -> int:
        return int(self.sampling.get("max_tokens") or _neutral().max_tokens)

    def spec_sampling(self) -> dict[str, Any]:
        """What crosses to the replica: the sampling, with the request's eviction options in ``extra_args``."""
        if not (self.eviction and self.eviction.extra_args):
            return dict(self.sampling)
        return {**self.sampling, "extra_args": {**(self.sampling.get("extra_args") or {}), **self.eviction.extra_args}}


# ---------------------------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """The model's tokenizer at the gateway, for prompts, chat templates and /tokenize (the engine gets ids)."""

    def __init__(self, folder: str | None):
        self.tok = None
        self._variables: frozenset[str] | None = None  # the chat template's, once
        self._arguments: frozenset[str] | None = None
        self.defaults = generation_defaults(folder)  # the model's sampling defaults, as `vllm serve` applies
        if folder is not None:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(folder)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tok is None:  # fake engine: one token per byte
            return list(text.encode())
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def token_strs(self, ids: list[int]) -> list[str]:
        if self.tok is None:
            return [chr(i) for i in ids]
        return list(self.tok.convert_ids_to_tokens(ids))

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return bytes(i % 256 for i in ids).decode(errors="replace")
        return self.tok.decode(ids)

    def template_variables(self) -> frozenset[str]:
        """The variables the model's chat template reads (jinja2's undeclared variables of the parsed template)."""
        if self._variables is None:
            self._variables = template_variables(getattr(self.tok, "chat_template", None))
        return self._variables

    def template_arguments(self) -> frozenset[str]:
        """What ``apply_chat_template`` takes as its own arguments, and the variables it sets itself (messages):
        never a request's template variable."""
        import inspect

        if self._arguments is None:
            fn = getattr(self.tok, "apply_chat_template", None)
            params = inspect.signature(fn).parameters.values() if fn is not None else ()
            own = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            self._arguments = frozenset(own | RENDERER_ARGUMENTS)
        return self._arguments

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if self.tok is None:
            return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))
        try:
            text = self.tok.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as e:  # templates raise on role orders they do not support
            raise BadRequest(f"messages do not fit the model's chat template: {str(e).splitlines()[0]}") from None
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))


# Names transformers' apply_chat_template takes or sets itself when it renders (its signature, and the variables it
# passes the template), whatever a tokenizer's own signature lists.
RENDERER_ARGUMENTS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def template_variables(template: Any) -> frozenset[str]:
    """The undeclared variables of a jinja2 chat template (a string, or named templates), parsed as vLLM parses it
    (vllm/renderers/hf.py _resolve_chat_template_kwargs: a sandboxed environment with loop controls and the
    ``{% generation %}`` tag). A template that does not parse reads nothing a request may set."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_noop"), [], [], body).set_lineno(lineno)

    texts = list(template.values()) if isinstance(template, dict) else [template] if isinstance(template, str) else []
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[_Generation, jinja2.ext.loopcontrols])
    found: set[str] = set()
    for text in texts:
        try:
            found |= jinja2.meta.find_undeclared_variables(env.parse(text))
        except jinja2.TemplateError:
            continue
    return frozenset(found)
