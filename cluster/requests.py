"""Validation of a Generate request at the gateway: every refusal is a ``BadRequest`` (INVALID_ARGUMENT)
with a message that says which field is wrong and why. Nothing here touches Ray or the engine."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.proto import vtoken_pb2 as pb


class BadRequest(ValueError):
    """The request cannot be served as sent."""


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant"]
    content: str = Field(..., min_length=1)


class ValidRequest(BaseModel):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    deadline_s: float | None


def parse(raw: bytes) -> pb.GenerateRequest:
    """Bytes off the wire to a message; malformed bytes and unknown fields are refused, not dropped."""
    msg = pb.GenerateRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise BadRequest(f"malformed GenerateRequest: {e}") from None
    for m in (msg, msg.sampling, *msg.messages.messages):
        unknown = UnknownFieldSet(m)
        if len(unknown):
            nums = ", ".join(str(f.field_number) for f in unknown)
            raise BadRequest(f"unknown field number(s) {nums} in {type(m).__name__}")
    return msg


def validate(msg: pb.GenerateRequest, tokenizer, max_model_len: int, max_prompt_chars: int) -> ValidRequest:
    rid = msg.request_id or uuid.uuid4().hex
    if len(rid) > 128 or not rid.isprintable():
        raise BadRequest("request_id must be printable and at most 128 characters")
    s = msg.sampling
    fields = {f: getattr(s, f) for f in ("temperature", "top_p", "top_k", "max_tokens", "seed") if s.HasField(f)}
    try:
        sampling = Sampling(**fields, stop=list(s.stop), ignore_eos=s.ignore_eos)
    except ValidationError as e:
        raise BadRequest(
            "invalid sampling: " + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        ) from None
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
    if len(ids) + sampling.max_tokens > max_model_len:
        raise BadRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens"
        )
    deadline = msg.deadline_ms / 1000 if msg.deadline_ms > 0 else None
    if msg.deadline_ms < 0:
        raise BadRequest("deadline_ms must be >= 0")
    return ValidRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling, deadline_s=deadline)


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
