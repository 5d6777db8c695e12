"""Validation of a request at the gateway, whichever door it came in by: every refusal is a ``BadRequest``
(gRPC INVALID_ARGUMENT, HTTP 400) with a message that says which field is wrong and why, and ``param`` naming
it. The gRPC door parses its proto here (``parse``, ``validate``); the HTTP door (cluster/openai_requests.py)
builds the same ``Sampling`` and uses the same checks for the prompt's length and for a request's own eviction
options (``vtoken_options``). Nothing here touches Ray or the engine."""

from __future__ import annotations

import math
import uuid
from typing import Any, Literal, NamedTuple

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.proto import vtoken_pb2 as pb
from vtoken.vllm_adapter.config import REQUEST_KEYS, VTokenConfig, request_args


class BadRequest(ValueError):
    """The request cannot be served as sent; ``param`` names the field at fault when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Sampling(BaseModel):
    """Sampling values accepted from clients (the fields of vllm.SamplingParams they map to)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    max_tokens: int = Field(16, ge=1, description="tokens to generate; at most max_model_len - prompt")
    seed: int | None = Field(None, ge=0, description="per-request seed")
    stop: list[str] = Field(default_factory=list, max_length=16, description="stop strings")
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's presence penalty")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's frequency penalty")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="return each sampled token's log-probability and this many alternatives"
    )

    def to_vllm(self, extra_args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams`` (what ``GenerateSpec.sampling`` carries)."""
        out = self.model_dump(exclude_none=True)
        if not out["stop"]:
            out.pop("stop")
        if extra_args:
            out["extra_args"] = extra_args
        return out


def sampling(fields: dict[str, Any], prefix: str = "") -> Sampling:
    """``Sampling(**fields)`` or a BadRequest naming every bad field (``prefix`` + its name)."""
    try:
        return Sampling(**fields)
    except ValidationError as e:
        errs = e.errors()
        raise BadRequest(
            "; ".join(f"{prefix}{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in errs),
            prefix + ".".join(map(str, errs[0]["loc"])),
        ) from None


class Eviction(NamedTuple):
    """A request's own eviction options as checked: ``extra_args`` for ``SamplingParams`` (None when it chose
    none) and ``config``, the served VTokenConfig with them applied (its budget bounds the request's blocks)."""

    extra_args: dict[str, Any] | None
    config: VTokenConfig


def vtoken_options(options: Any, served: dict[str, Any]) -> Eviction:
    """The one check of a request's eviction options, for both doors (gRPC ``VTokenOptions``, HTTP's
    ``"vtoken": {...}``): a mapping of ``request_args`` keys (policy, budget, interval, sink, recent, seed,
    policy_params, prefill_evict, prefill_window) that ``request_args`` accepts and that the served config
    accepts too (``VTokenConfig.for_request``: e.g. h2o on an engine that collects no attention scores is
    refused). What passes is exactly what the engine will accept; refusals are BadRequest naming vtoken.<key>."""
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
        errs = e.errors()
        where = [".".join(["vtoken", *map(str, err["loc"])]) for err in errs]
        raise BadRequest(
            "; ".join(f"{w}: {err['msg'].removeprefix('Value error, ')}" for w, err in zip(where, errs)), where[0]
        ) from None
    except (ValueError, TypeError, OverflowError) as e:  # the policy's own checks, its parameters
        field = "vtoken.policy" if "policy" in str(e) else "vtoken"
        raise BadRequest(f"{field}: {str(e).splitlines()[0]}", field) from None
    return Eviction(extra, effective)


def check_length(n_prompt: int, max_tokens: int, max_model_len: int, field: str = "max_tokens") -> None:
    if n_prompt + max_tokens > max_model_len:
        raise BadRequest(
            f"prompt ({n_prompt} tokens) + {field} ({max_tokens}) exceeds the model's context of {max_model_len} "
            "tokens",
            field,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant"]
    content: str = Field(..., min_length=1)


class ValidRequest(BaseModel):
    """A request either door has validated: what the dispatcher places and the engine runs."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    request_id: str  # the client's (gRPC request_id; empty over HTTP); engines know the gateway's own id
    prompt_token_ids: list[int]
    sampling: Sampling
    deadline_s: float | None = None
    eviction: Eviction | None = None  # the request's own eviction options, checked (vtoken_options)

    def spec_sampling(self) -> dict[str, Any]:
        return self.sampling.to_vllm(self.eviction.extra_args if self.eviction else None)


def parse(raw: bytes) -> pb.GenerateRequest:
    """Bytes off the wire to a message; malformed bytes and unknown fields are refused, not dropped."""
    msg = pb.GenerateRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise BadRequest(f"malformed GenerateRequest: {e}") from None
    for m in (msg, msg.sampling, msg.vtoken, *msg.messages.messages):
        unknown = UnknownFieldSet(m)
        if len(unknown):
            nums = ", ".join(str(f.field_number) for f in unknown)
            raise BadRequest(f"unknown field number(s) {nums} in {type(m).__name__}")
    return msg


def options_from_proto(o: pb.VTokenOptions) -> dict[str, Any]:
    """The fields a client set in ``VTokenOptions`` as ``request_args`` keywords (unset fields are absent)."""
    out: dict[str, Any] = {
        f: getattr(o, f)
        for f in ("policy", "budget", "interval", "sink", "recent", "seed", "prefill_evict", "prefill_window")
        if o.HasField(f)
    }
    if o.HasField("policy_params"):
        # A Struct carries every number as a double; policy parameters are mostly counts (history=32).
        params = MessageToDict(o.policy_params)
        out["policy_params"] = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in params.items()}
    return out


def validate(
    msg: pb.GenerateRequest,
    tokenizer,
    max_model_len: int,
    max_prompt_chars: int,
    served_vtoken: dict[str, Any] | None = None,
) -> ValidRequest:
    rid = msg.request_id or uuid.uuid4().hex
    if len(rid) > 128 or not rid.isprintable():
        raise BadRequest("request_id must be printable and at most 128 characters", "request_id")
    s = msg.sampling
    fields = {f: getattr(s, f) for f in ("temperature", "top_p", "top_k", "max_tokens", "seed") if s.HasField(f)}
    sampling_ = sampling({**fields, "stop": list(s.stop), "ignore_eos": s.ignore_eos}, "sampling.")
    eviction = vtoken_options(options_from_proto(msg.vtoken), served_vtoken or {"mode": "vtoken"})
    which = msg.WhichOneof("input")
    if which == "prompt":
        if not msg.prompt.strip():
            raise BadRequest("prompt is empty")
        if len(msg.prompt) > max_prompt_chars:
            raise BadRequest(f"prompt has {len(msg.prompt)} characters; the limit is {max_prompt_chars}")
        ids = tokenizer.encode(msg.prompt)
    elif which == "messages":
        try:
            chat = [ChatMessage(role=m.role, content=m.content) for m in msg.messages.messages]
        except ValidationError as e:
            raise BadRequest("invalid chat message: " + "; ".join(err["msg"] for err in e.errors())) from None
        if not chat:
            raise BadRequest("messages is empty")
        if sum(len(m.content) for m in chat) > max_prompt_chars:
            raise BadRequest(f"messages exceed {max_prompt_chars} characters")
        ids = tokenizer.encode_chat([m.model_dump() for m in chat])
    else:
        raise BadRequest("set either prompt or messages")
    check_length(len(ids), sampling_.max_tokens, max_model_len, "sampling.max_tokens")
    deadline = msg.deadline_ms / 1000 if msg.deadline_ms > 0 else None
    if msg.deadline_ms < 0:
        raise BadRequest("deadline_ms must be >= 0", "deadline_ms")
    return ValidRequest(
        request_id=rid, prompt_token_ids=ids, sampling=sampling_, deadline_s=deadline, eviction=eviction
    )


class Tokenizer:
    """The model's tokenizer for counting and rendering prompts at the gateway (the engine gets token ids)."""

    def __init__(self, folder: str | None):
        self.tok = None
        if folder is not None:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(folder)

    def encode(self, text: str) -> list[int]:
        if self.tok is None:  # fake engine: one token per byte
            return list(text.encode())
        return list(self.tok.encode(text))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tok is None:
            return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # templates raise on role orders they do not support
            raise BadRequest(f"messages do not fit the model's chat template: {e}") from None
        return list(self.tok.encode(text, add_special_tokens=False))
