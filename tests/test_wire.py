"""What crosses between the gateway and a replica (actors/wire.py), without a server: the request's SamplingParams
as its non-neutral fields (the replica rebuilds an equal object), and vLLM's RequestOutput as a Chunk through
msgpack and back, with every field vLLM's serving layer reads (n > 1, log-probabilities, prompt log-probabilities
for echo, stop reasons, the prefix-cache hit)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import StructuredOutputsParams

from actors.wire import Chunk, Seq, from_output, merge, pack, sampling_kwargs, to_output, unpack


def test_what_crosses_to_the_replica_rebuilds_an_equal_sampling_params():
    cases = [
        {},
        {"temperature": 0.0, "top_k": 5, "min_p": 0.3},  # greedy: vLLM resets top_k and min_p; so must we
        {"temperature": 0.8, "top_p": 0.9, "seed": -1, "stop": "x", "logprobs": 3, "logit_bias": {"3": 200}},
        {"repetition_penalty": 1.2, "bad_words": ["a", "a"], "stop_token_ids": [4, 4, 5], "min_tokens": 2},
        {"include_stop_str_in_output": True, "skip_special_tokens": False, "extra_args": {"k": 1}},
        {"n": 3, "prompt_logprobs": 1, "structured_outputs": StructuredOutputsParams(json_object=True)},
        {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"]), "max_tokens": 4},
    ]
    for kw in cases:
        params = SamplingParams.from_optional(**kw)
        sent = sampling_kwargs(params)
        again = SamplingParams.from_optional(**sent)
        assert {f: getattr(again, f) for f in again.__struct_fields__} == {
            f: getattr(params, f) for f in params.__struct_fields__
        }, kw
    assert sampling_kwargs(SamplingParams.from_optional()) == {}


def _position(token: int, lp: float, others: dict[int, float]) -> dict[int, Logprob]:
    pos = {token: Logprob(lp, 1, f"<{token}>")}
    pos.update({t: Logprob(v, rank, f"<{t}>") for rank, (t, v) in enumerate(others.items(), start=2)})
    return pos


def test_a_request_output_crosses_whole_and_comes_back_as_vllms():
    outputs = [
        CompletionOutput(0, " a b", [5, 6], -1.5, [_position(5, -0.5, {9: -2.0}), _position(6, -1.0, {})]),
        CompletionOutput(
            1, " c", [7], -0.25, [_position(7, -math.inf, {8: -0.1})], finish_reason="stop", stop_reason="\n"
        ),  # fmt: skip
    ]
    prompt_lps = [None, _position(3, -4.0, {4: -0.5})]
    out = RequestOutput("r", None, [1, 3], prompt_lps, outputs, finished=True, num_cached_tokens=32)
    chunk = from_output(out)
    assert unpack(pack(chunk)) == chunk and chunk.tokens == 3 and chunk.finish_reason == "stop"
    back = to_output(unpack(pack(chunk)), "serving-id", "the prompt", [1, 3])
    assert back.request_id == "serving-id" and back.prompt == "the prompt" and back.prompt_token_ids == [1, 3]
    assert back.finished and back.num_cached_tokens == 32
    assert back.prompt_logprobs == prompt_lps
    for got, want in zip(back.outputs, outputs, strict=True):
        assert (got.index, got.text, got.token_ids, got.cumulative_logprob, got.finish_reason, got.stop_reason) == (
            want.index, want.text, want.token_ids, want.cumulative_logprob, want.finish_reason, want.stop_reason,
        )  # fmt: skip
        assert got.logprobs == want.logprobs
    assert list(back.outputs[1].logprobs[0])[0] == 7  # the sampled token first, as vLLM orders them


def test_a_failed_request_is_one_line():
    c = Chunk.failed("invalid_argument", "stop cannot contain an empty string.\nTraceback ...")
    assert unpack(pack(c)) == c and c.error == "stop cannot contain an empty string." and not c.seqs


# ------------------------------------------------------------------------------ merged deltas (actors/wire.merge)
def _alt(t: int) -> tuple:
    return (t, -0.5 * t, 1, f"<{t}>")


@st.composite
def _deltas(draw):
    """A request's consecutive DELTA chunks as a replica sends them: n sequences, each getting tokens (with or
    without log-probabilities, as the request asked) and a finish reason on its last; prompt logprobs and the cache
    hit on the first chunk only."""
    n, with_lps = draw(st.integers(1, 3)), draw(st.booleans())
    chunks, done = [], set()
    for k in range(draw(st.integers(1, 5))):
        seqs = []
        for i in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)):
            if i in done:
                continue
            ids = tuple(draw(st.lists(st.integers(0, 50), max_size=3)))
            reason = draw(st.sampled_from([None, None, "stop", "length"]))
            if reason:
                done.add(i)
            lps = tuple((_alt(t),) for t in ids) if with_lps else None
            seqs.append(Seq(i, "".join(f" w{t}" for t in ids), ids, lps, -0.1 * (k + 1), reason,
                            "\n" if reason == "stop" else None))  # fmt: skip
        first = k == 0
        chunks.append(Chunk(tuple(seqs), False, ((None, (_alt(3),)) if first else None), 32 if first else None))
    chunks[-1] = chunks[-1]._replace(finished=draw(st.booleans()))
    return chunks


def _as_vllm(out: RequestOutput) -> list:
    return [(o.index, o.text, list(o.token_ids), o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason)
            for o in sorted(out.outputs, key=lambda o: o.index)]  # fmt: skip


def _vllm_merged(chunks: list[Chunk]) -> RequestOutput:
    """The reference: vLLM's own merge of the same deltas (what AsyncLLM's RequestOutputCollector does)."""
    merged = to_output(chunks[0], "r", None, [1, 3])
    for c in chunks[1:]:
        merged.add(to_output(c, "r", None, [1, 3]), aggregate=True)
    return merged


@given(_deltas())
def test_merged_deltas_are_what_vllm_merges(chunks):
    want, got = _vllm_merged(chunks), to_output(merge(*chunks), "r", None, [1, 3])
    assert _as_vllm(got) == _as_vllm(want)
    assert (got.finished, got.prompt_logprobs, got.num_cached_tokens) == (
        want.finished, want.prompt_logprobs, want.num_cached_tokens)  # fmt: skip
    assert merge(*chunks).tokens == sum(c.tokens for c in chunks)


def test_the_merge_test_can_fail():
    """Negative control: a merge that keeps the first cumulative log-probability, or drops a sequence's later
    text, is told apart from vLLM's."""
    chunks = [Chunk((Seq(0, " a", (1,), None, -0.1),)), Chunk((Seq(0, " b", (2,), None, -0.3, "stop"),), True)]
    want = _as_vllm(_vllm_merged(chunks))
    assert _as_vllm(to_output(merge(*chunks), "r", None, [1])) == want
    stale = merge(*chunks)._replace(seqs=(merge(*chunks).seqs[0]._replace(cumulative_logprob=-0.1),))
    assert _as_vllm(to_output(stale, "r", None, [1])) != want
    assert _as_vllm(to_output(merge(chunks[0]), "r", None, [1])) != want
