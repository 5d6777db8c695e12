"""The gRPC door's requests: protobuf bytes -> ``GenerateRequest`` -> OpenAI's JSON shape -> vLLM's own protocol model
and serving class, so a gRPC request is checked and rendered by exactly the code that serves an HTTP one (vLLM's
``CompletionRequest`` or ``ChatCompletionRequest``, the chat template through the same ``OnlineRenderer``, vLLM's
``SamplingParams`` with the model's generation defaults), then streamed by the same remote engine client.
"""

from __future__ import annotations

import math
import uuid
import warnings
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from cluster.proto import vtoken_pb2 as pb
from cluster.serving.requests import BadRequest, RequestContext, vtoken_options


class Rendered(NamedTuple):
    """A gRPC request as vLLM's serving layer renders it: ``prompt`` the engine input (token ids), ``params`` vLLM's
    ``SamplingParams`` (DELTA: the door streams what each step adds), ``context`` what the door knows beside them."""

    prompt: Any
    params: Any
    context: RequestContext


def parse(raw: bytes) -> pb.GenerateRequest:
    """Bytes off the wire to a message; malformed bytes and unknown fields are refused, not dropped."""
    msg = pb.GenerateRequest()
    try:
        msg.ParseFromString(raw)
    except (DecodeError, RecursionError) as e:
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
        for f in (
            "policy",
            "budget",
            "interval",
            "sink",
            "recent",
            "seed",
            "prefill_evict",
            "prefill_window",
            "evict",
            "pressure_floor",
        )  # fmt: skip
        if o.HasField(f)
    }
    if o.HasField("policy_params"):
        # A Struct carries every number as a double; policy parameters are mostly counts (history=32).
        params = MessageToDict(o.policy_params)
        out["policy_params"] = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in params.items()}
    return out


def sampling_fields(s: pb.SamplingParams) -> dict[str, Any]:
    """The sampling fields a client set, under OpenAI's names (unset optional fields and empty lists absent)."""
    out: dict[str, Any] = {}
    for field in s.DESCRIPTOR.fields:
        name = field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = {str(k): v for k, v in getattr(s, name).items()}  # JSON's logit_bias keys are strings
        elif field.is_repeated:
            value = list(getattr(s, name))
        elif field.has_presence:
            value = getattr(s, name) if s.HasField(name) else None
        else:
            value = getattr(s, name) or None  # ignore_eos: false is the default
        if value in (None, [], {}):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):  # vLLM's range checks let NaN through
                raise BadRequest(f"sampling.{name}: must be a finite number", f"sampling.{name}")
            if field.type == field.TYPE_FLOAT:  # 0.7f arrives as 0.699999988: the client meant 0.7
                value = float(str(np.float32(value)))
        out[name] = value
    return out


async def render(msg: pb.GenerateRequest, state: Any, model_name: str, served_vtoken: dict[str, Any]) -> Rendered:
    """The request checked and rendered by vLLM's serving classes in ``state`` (vLLM's app state); BadRequest for
    anything they refuse, with their message."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    rid = msg.request_id or uuid.uuid4().hex
    if len(rid) > 128 or not rid.isprintable():
        raise BadRequest("request_id must be printable and at most 128 characters", "request_id")
    if msg.deadline_ms < 0:
        raise BadRequest("deadline_ms must be >= 0", "deadline_ms")
    body = {**sampling_fields(msg.sampling), "model": model_name}
    which = msg.WhichOneof("input")
    if which == "prompt":
        cls, serving, body["prompt"] = CompletionRequest, state.openai_serving_completion, msg.prompt
    elif which == "messages":
        cls, serving = ChatCompletionRequest, state.openai_serving_chat
        body["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
    else:
        raise BadRequest("set either prompt or messages")
    eviction = vtoken_options(options_from_proto(msg.vtoken), served_vtoken)
    try:
        with warnings.catch_warnings():  # max_tokens is deprecated in vLLM's chat model, not in OpenAI's API
            warnings.simplefilter("ignore", DeprecationWarning)
            request = cls.model_validate(body)
        if which == "prompt":
            result = await serving.render_completion_request(request)
        else:
            result = await serving.render_chat_request(request)
        if isinstance(result, ErrorResponse):
            raise BadRequest(result.error.message, result.error.param)
        inputs = result if which == "prompt" else result[1]
        (prompt,) = inputs
        max_tokens = get_max_tokens(
            serving.model_config.max_model_len,
            request.max_tokens,
            len(prompt["prompt_token_ids"]),
            serving.default_sampling_params,
            serving.override_max_tokens,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        params = request.to_sampling_params(max_tokens, serving.default_sampling_params)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or _is_field(p))
        text = err["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{loc}: {text}" if loc else text, loc or None) from None
    except (VLLMClientError, ValueError, TypeError, OverflowError) as e:
        param = getattr(e, "parameter", None)
        text = str(e.args[0] if e.args else e).splitlines()[0]
        raise BadRequest(f"{param}: {text}" if param and not text.startswith(param) else text, param) from None
    params.output_kind = RequestOutputKind.DELTA
    deadline = msg.deadline_ms / 1000 if msg.deadline_ms > 0 else None
    ctx = RequestContext(door="grpc", eviction=eviction, deadline_s=deadline, client_id=rid, seen={})
    return Rendered(prompt, params, ctx)


def _is_field(part: Any) -> bool:
    """A loc part that names a field, not a union branch pydantic tried (``str``, ``ChatCompletion...``)."""
    return isinstance(part, str) and part.isidentifier() and part.islower() and part not in {"str", "int", "list"}
