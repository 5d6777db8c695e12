"""What crosses between the gateway and a replica: a request (``GenerateSpec``) one way, the engine's outputs
(``Chunk``) the other, small named picklable types with a msgpack codec for the token channel.

A ``Chunk`` is vLLM's ``RequestOutput`` reduced to the fields vLLM's serving layer reads (the gateway runs vLLM's
OpenAI serving classes over a remote engine: cluster/serving/remote_engine.py): per sequence its index, new text and
token ids, their log-probabilities, the cumulative log-probability, finish and stop reasons; per request whether it
finished, the prompt's log-probabilities (first chunk only) and its prefix-cache hit. The prompt itself never
travels back: the gateway rendered it and keeps it. A request the replica could not serve is a Chunk with
``error`` and ``code`` set and nothing else.

    replica: AsyncLLM.generate -> RequestOutput (DELTA) --from_output--> Chunk --pack--> bytes
    gateway: bytes --unpack--> Chunk --to_output--> RequestOutput -> vLLM's serving classes

Log-probabilities travel as ``(token_id, logprob, rank, decoded_token)`` per alternative, one tuple of them per
position in vLLM's order (the sampled token first). ``-inf`` travels as is (msgpack is binary); vLLM's serving
layer clamps it for JSON.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

# Chunk.code values and what the client sees: the gateway maps them to its statuses.
ERROR_CODES = ("invalid_argument", "unavailable", "internal")

Alternative = tuple[int, float, "int | None", "str | None"]  # (token_id, logprob, rank, decoded_token)
Position = tuple[Alternative, ...]


@dataclass(frozen=True)
class GenerateSpec:
    """One request as it crosses from the gateway to a replica: the rendered prompt's token ids, and the request's
    ``vllm.SamplingParams`` as the fields that differ from their neutral values (``sampling_kwargs``;
    ``SamplingParams.from_optional(**sampling)`` rebuilds it, and a fake replica reads it without importing vLLM),
    with ``extra_args["vtoken"]`` = the request's own eviction options when it chose some; ``engine_kwargs``: the
    arguments of ``AsyncLLM.generate`` vLLM's serving layer set beside them (priority, reasoning_ended,
    reasoning_parser_kwargs) and the prompt's ``cache_salt``, which the replica puts back in the prompt.
    ``request_id`` is the gateway's, unique per stream (never the client's, which clients may reuse).
    ``max_tokens`` and ``n``: what the request may generate, per sequence, and its sequences, as the gateway placed
    it (set once where the request is validated, cluster/serving/remote_engine.py); what a replica counts the
    request's work and blocks by."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    max_tokens: int
    n: int = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


class Seq(NamedTuple):
    """One sequence's new output (vLLM's ``CompletionOutput`` in DELTA mode)."""

    index: int = 0
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Position, ...] | None = None  # one position per token in token_ids, when asked for
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Chunk(NamedTuple):
    """A streamed delta of a request's outputs; ``error`` and ``code`` (one of ERROR_CODES) are set, and nothing
    else, when the request failed. ``error`` is one line meant for the client: no traceback, no internals."""

    seqs: tuple[Seq, ...] = ()
    finished: bool = False
    prompt_logprobs: tuple[Position | None, ...] | None = None
    num_cached_tokens: int | None = None
    error: str = ""
    code: str = ""

    @classmethod
    def failed(cls, code: str, message: str) -> Chunk:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}; known: {', '.join(ERROR_CODES)}")
        return cls(error=one_line(message), code=code)

    @property
    def tokens(self) -> int:
        """New tokens in this chunk, over every sequence."""
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def finish_reason(self) -> str:
        """The first finish reason among this chunk's sequences ("" while none finished)."""
        return next((s.finish_reason for s in self.seqs if s.finish_reason), "")

    @property
    def aborted(self) -> bool:
        """The engine aborted the request (vLLM's finish reason "abort"): a drain, a restart, not the client."""
        return any(s.finish_reason == "abort" for s in self.seqs)


def one_line(message: str, limit: int = 300) -> str:
    lines = str(message).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# What vLLM's AsyncLLM yields last for a request aborted by ``AsyncLLM.abort`` (the fake does the same).
ABORTED = Chunk((Seq(finish_reason="abort"),), finished=True)


def merge(first: Chunk, *rest: Chunk) -> Chunk:
    """Consecutive deltas of one request as one, as vLLM merges them (``RequestOutput.add(aggregate=True)``, which
    tests/test_wire.py holds this to): per sequence index the texts, token ids and log-probabilities joined, the
    last cumulative log-probability and finish and stop reasons; the first chunk's prompt log-probabilities and
    cache hit; finished if any is. Failed chunks are never merged."""
    seqs: dict[int, list] = {}
    for c in (first, *rest):
        for s in c.seqs:
            have = seqs.get(s.index)
            if have is None:
                seqs[s.index] = [s.text, list(s.token_ids), None if s.logprobs is None else list(s.logprobs), s]
                continue
            have[0] += s.text
            have[1].extend(s.token_ids)
            if s.logprobs:
                if have[2] is None:
                    have[2] = []
                have[2].extend(s.logprobs)
            have[3] = s
    return Chunk(
        tuple(
            Seq(
                i,
                text,
                tuple(ids),
                None if lps is None else tuple(lps),
                last.cumulative_logprob,
                last.finish_reason,
                last.stop_reason,
            )
            for i, (text, ids, lps, last) in seqs.items()
        ),
        any(c.finished for c in (first, *rest)),
        first.prompt_logprobs,
        first.num_cached_tokens,
    )


# ---------------------------------------------------------------------------------------------- the codec
def pack(chunk: Chunk) -> bytes:
    return msgpack.packb(chunk, use_bin_type=True)


def unpack(payload: bytes) -> Chunk:
    seqs, finished, prompt_lps, cached, error, code = msgpack.unpackb(payload, raw=False)
    return Chunk(
        tuple(
            Seq(i, text, tuple(ids), None if lps is None else _positions(lps), cum, reason, stop)
            for i, text, ids, lps, cum, reason, stop in seqs
        ),
        finished,
        None if prompt_lps is None else tuple(None if p is None else _position(p) for p in prompt_lps),
        cached,
        error,
        code,
    )


def _position(p: list) -> Position:
    return tuple(tuple(a) for a in p)


def _positions(ps: list) -> tuple[Position, ...]:
    return tuple(tuple(tuple(a) for a in p) for p in ps)


# ---------------------------------------------------------------------------------------------- vLLM's types
def _from_logprobs(positions) -> tuple[Position, ...]:
    """vLLM's per-position ``{token_id: Logprob}`` (a list of dicts or FlatLogprobs) as plain tuples."""
    return tuple(
        tuple((int(t), float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in position.items())
        for position in positions
    )


def from_output(out) -> Chunk:
    """A ``vllm.RequestOutput`` (DELTA mode) as a Chunk (replica side)."""
    seqs = tuple(
        Seq(
            c.index,
            c.text,
            tuple(c.token_ids),
            None if c.logprobs is None else _from_logprobs(c.logprobs),
            c.cumulative_logprob,
            c.finish_reason,
            c.stop_reason,
        )
        for c in out.outputs
    )
    prompt = out.prompt_logprobs
    prompt_lps = None
    if prompt is not None:
        prompt_lps = tuple(None if p is None else _from_logprobs((p,))[0] for p in prompt)
    return Chunk(seqs, out.finished, prompt_lps, out.num_cached_tokens)


def _to_logprobs(positions: tuple[Position | None, ...], logprob_cls) -> list:
    return [
        None if p is None else {t: logprob_cls(logprob=lp, rank=rank, decoded_token=tok) for t, lp, rank, tok in p}
        for p in positions
    ]


def to_output(chunk: Chunk, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None):
    """A Chunk as the ``vllm.RequestOutput`` vLLM's serving layer reads (gateway side); the prompt is the one the
    gateway rendered."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    outputs = [
        CompletionOutput(
            index=s.index,
            text=s.text,
            token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=None if s.logprobs is None else _to_logprobs(s.logprobs, Logprob),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
        for s in chunk.seqs
    ]
    prompt_lps = None if chunk.prompt_logprobs is None else _to_logprobs(chunk.prompt_logprobs, Logprob)
    return RequestOutput(request_id, prompt, prompt_token_ids, prompt_lps, outputs, chunk.finished,
                         num_cached_tokens=chunk.num_cached_tokens)  # fmt: skip


# ---------------------------------------------------------------------------------------------- sampling
@functools.cache
def _neutral():
    from vllm import SamplingParams

    return SamplingParams.from_optional()


@functools.cache
def _sampling_fields() -> tuple[str, ...]:
    """The arguments of ``SamplingParams.from_optional`` a request can set (how the replica rebuilds them)."""
    from vllm import SamplingParams

    skip = {"output_kind", "skip_clone"}  # the replica streams deltas; a fresh object needs no clone
    return tuple(k for k in inspect.signature(SamplingParams.from_optional).parameters if k not in skip)


def sampling_kwargs(params) -> dict[str, Any]:
    """The fields of a ``vllm.SamplingParams`` that differ from its neutral values: a small picklable dict from
    which ``SamplingParams.from_optional(**kwargs)`` rebuilds an equal object (tests/test_wire.py)."""
    neutral, empty = _neutral(), (None, [], {})  # an empty list or mapping means what None means
    out = {}
    for k in _sampling_fields():
        v, n = getattr(params, k), getattr(neutral, k)
        if v != n and not (v in empty and n in empty):
            out[k] = v
    return out
