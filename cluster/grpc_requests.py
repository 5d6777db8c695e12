"""The gRPC door's requests: protobuf bytes -> ``GenerateRequest`` -> OpenAI's JSON shape -> the shared request
model (cluster/requests.py), so a gRPC request is checked by exactly the code that checks an HTTP one: vLLM's
protocol models, vLLM's SamplingParams, the same roles, prompt limits and eviction options, the same messages.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import numpy as np
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from cluster.proto import vtoken_pb2 as pb
from cluster.requests import BadRequest, Limits, ValidRequest, chat, completion, vtoken_options
from vtoken.prefix_hash import prefix_hashes


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


def validate(
    msg: pb.GenerateRequest,
    tokenizer,
    max_model_len: int,
    max_prompt_chars: int,
    served_vtoken: dict[str, Any] | None = None,
    max_logprobs: int = 20,
    block_size: int = 0,
) -> ValidRequest:
    """The request checked, its prompt rendered and tokenized; with ``block_size``, its prompt's block hashes."""
    rid = msg.request_id or uuid.uuid4().hex
    if len(rid) > 128 or not rid.isprintable():
        raise BadRequest("request_id must be printable and at most 128 characters", "request_id")
    if msg.deadline_ms < 0:
        raise BadRequest("deadline_ms must be >= 0", "deadline_ms")
    body = sampling_fields(msg.sampling)
    limits = Limits(max_model_len, max_prompt_chars, max_logprobs)
    which = msg.WhichOneof("input")
    if which == "prompt":
        parsed = completion({**body, "prompt": msg.prompt}, tokenizer, limits)
    elif which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
        parsed = chat({**body, "messages": messages}, tokenizer, limits)
    else:
        raise BadRequest("set either prompt or messages")
    eviction = vtoken_options(options_from_proto(msg.vtoken), served_vtoken or {"mode": "vtoken"})
    deadline = msg.deadline_ms / 1000 if msg.deadline_ms > 0 else None
    return ValidRequest(
        request_id=rid,
        prompt_token_ids=parsed.prompt_token_ids,
        sampling=parsed.sampling,
        deadline_s=deadline,
        eviction=eviction,
        prefix_hashes=prefix_hashes(parsed.prompt_token_ids, block_size) if block_size else (),
    )
