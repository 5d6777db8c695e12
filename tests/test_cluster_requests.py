"""Request validation for both doors (gRPC mapped onto vLLM's own request models) and a request's own eviction
options, checked once. No Ray."""

from __future__ import annotations

import pytest

from cluster.grpc_requests import parse, validate
from cluster.proto import vtoken_pb2 as pb
from cluster.requests import BadRequest, Tokenizer


# ------------------------------------------------------------------------------ requests
def req(**kw):
    return pb.GenerateRequest(**kw).SerializeToString()


@pytest.mark.parametrize(
    "raw, needle",
    [
        (req(prompt=""), "prompt: Either prompt or prompt_embeds must be provided and non-empty"),
        (req(prompt="   "), "prompt: must not be empty"),
        (req(), "set either prompt or messages"),
        (req(prompt="x" * 200), "characters; the limit is 100"),
        (req(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (req(prompt="hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
        (req(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (req(prompt="hi", sampling=pb.SamplingParams(max_tokens=10**9)), "exceeds the model's context"),
        (req(prompt="hi", sampling=pb.SamplingParams(temperature=float("nan"))), "finite"),
        (req(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=0)), "repetition_penalty"),
        (req(prompt="hi", sampling=pb.SamplingParams(min_p=2)), "min_p"),
        (req(prompt="hi", deadline_ms=-5), "deadline_ms"),
        (req(messages=pb.ChatMessages()), "messages: must not be empty"),
        (req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])), "is not served"),
        (b"\xff\xff\xff", "malformed"),
        (req(prompt="hi") + b"\xa8\x06\x01", "unknown field"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(raw, needle):
    with pytest.raises(BadRequest, match=None) as e:
        validate(parse(raw), Tokenizer(None), max_model_len=64, max_prompt_chars=100)
    assert needle in str(e.value)


def test_an_empty_message_is_a_message_as_vllm_takes_it():
    """vLLM's ChatCompletionRequest takes a message whose content is empty (an assistant turn left blank, say): the
    chat template renders its turn. It was refused here; an audit against vLLM's protocol models found it."""
    from cluster.requests import messages

    assert messages([{"role": "user", "content": ""}, {"role": "assistant", "content": [{"type": "text", "text": ""}]}],
                    100) == [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]  # fmt: skip


def test_good_request_validates():
    r = validate(
        parse(req(prompt="hello", sampling=pb.SamplingParams(max_tokens=8, temperature=0))), Tokenizer(None), 64, 100
    )
    assert r.prompt_token_ids == list(b"hello") and r.max_tokens == 8 and r.request_id


def test_vtoken_options_from_the_proto_keep_counts_whole_and_unset_fields_absent():
    from cluster.grpc_requests import options_from_proto

    o = pb.VTokenOptions(policy="scissorhands", budget=0.25, prefill_evict=False, pressure_floor=0.5)
    o.policy_params.update({"history": 16})
    assert options_from_proto(o) == {
        "policy": "scissorhands",
        "budget": 0.25,
        "prefill_evict": False,
        "pressure_floor": 0.5,
        "policy_params": {"history": 16},
    }
    assert type(options_from_proto(o)["policy_params"]["history"]) is int
    assert options_from_proto(pb.VTokenOptions()) == {}


@pytest.mark.parametrize(
    "served, options, needle",
    [
        ({"mode": "vtoken", "policy": "streaming"}, {"policy": "h2o"}, "vtoken.policy: policy 'h2o' needs attention"),
        ({"mode": "vtoken"}, {"budgett": 0.5}, "vtoken.budgett: not a per-request option"),
        ({"mode": "vtoken"}, {"budget": float("nan")}, "vtoken.budget: must be a finite number"),
        ({"mode": "vtoken"}, {"budget": "lots"}, "vtoken.budget:"),
        ({"mode": "vtoken"}, {"policy": "random", "policy_params": {"history": 3}}, "no parameter"),
        ({"mode": "off"}, {"policy": "random"}, "eviction off"),
        ({"mode": "vtoken"}, ["h2o"], "expected an object"),
        ({"mode": "vtoken"}, {"pressure_floor": 1.5}, "vtoken.pressure_floor:"),
        ({"mode": "vtoken"}, {"evict": "always", "pressure_floor": 0.5}, "vtoken.pressure_floor: a floor is kept in"),
        # The request that took an engine down (issue 46): a policy parameter of the wrong type reached the scheduler.
        (
            {"mode": "vtoken"},
            {"policy": "scissorhands", "evict": "always", "policy_params": {"history": "a"}},
            "vtoken.policy_params.history: must be a whole number, got str 'a'",
        ),
        ({"mode": "vtoken"}, {"policy_params": {"before": "x"}}, "vtoken.policy_params.before: must be a whole number"),
        ({"mode": "vtoken"}, {"policy_params": {"before": 10**9}}, "vtoken.policy_params.before: must be >= 0 and"),
        ({"mode": "vtoken"}, {"policy": "h2o", "policy_params": {"recent": [1]}}, "vtoken.policy_params.recent: set"),
        ({"mode": "vtoken"}, {"policy": "scissorhands", "policy_params": {"history": 0}}, "policy_params.history"),
        ({"mode": "vtoken"}, {"policy": "h2o", "policy_params": {"score_every": 1.5}}, "policy_params.score_every"),
        ({"mode": "vtoken"}, {"policy": "random", "seed": -1}, "vtoken.seed:"),
    ],
)
def test_a_requests_eviction_options_are_checked_once_for_both_doors(served, options, needle):
    from cluster.requests import vtoken_options

    with pytest.raises(BadRequest) as e:
        vtoken_options(options, served)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(e.value.param + ":"), "the 400's param names the field its message starts with"


def test_accepted_eviction_options_become_request_args_and_bound_the_block_estimate():
    from cluster.requests import vtoken_options
    from vtoken.vllm_adapter import request_args

    ev = vtoken_options({"policy": "scissorhands", "budget": 0.125}, {"mode": "vtoken", "policy": "h2o"})
    assert ev.extra_args == request_args(policy="scissorhands", budget=0.125)
    assert ev.config.policy == "scissorhands" and ev.config.budget == 0.125
    assert vtoken_options(None, {"mode": "vtoken"}).extra_args is None
    ev = vtoken_options({"pressure_floor": 0.5}, {"mode": "vtoken"})  # a request that would rather wait than shed
    assert ev.extra_args == request_args(pressure_floor=0.5) and ev.config.pressure_floor == 0.5
    served = {"mode": "vtoken", "evict": "always", "pressure_floor": 0.5}  # the engine's own pair is its business
    assert vtoken_options({"budget": 0.25}, served).config.pressure_floor == 0.5
    assert vtoken_options({"pressure_floor": 0}, {"mode": "vtoken", "pressure_floor": 0.5}).config.pressure_floor == 0
    r = validate(
        parse(req(prompt="hi", vtoken=pb.VTokenOptions(policy="random", budget=0.5))),
        Tokenizer(None),
        64,
        100,
        {"mode": "vtoken"},
    )
    assert r.spec_sampling()["extra_args"] == {"vtoken": {"policy": "random", "budget": 0.5}}
