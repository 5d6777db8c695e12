"""The gRPC door's requests, rendered by vLLM's own serving classes (cluster/doors/grpc_requests.py: the protobuf mapped
onto OpenAI's JSON, then vLLM's protocol models, its renderer and its SamplingParams, as for HTTP), and a request's own
eviction options, checked once for both doors. No Ray: vLLM's app over an engine client that is never called."""

from __future__ import annotations

import asyncio

import pytest

from cluster.config import parse_config
from cluster.doors.grpc_requests import parse, render
from cluster.proto import vtoken_pb2 as pb
from cluster.serving.requests import BadRequest

CFG = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"port": 0, "http_port": 0}})


@pytest.fixture(scope="module")
def state():
    from types import SimpleNamespace

    from cluster.serving.frontend import serving_app

    return asyncio.run(serving_app(CFG, SimpleNamespace(inflight=0))).app.state  # rendering checks admission


def rendered(state, raw: bytes, served: dict | None = None):
    return asyncio.run(render(parse(raw), state, CFG.model_name, served or {"mode": "vtoken"}))


# ------------------------------------------------------------------------------ requests
def req(**kw):
    return pb.GenerateRequest(**kw).SerializeToString()


@pytest.mark.parametrize(
    "raw, needle",
    [
        (req(prompt=""), "prompt: Either prompt or prompt_embeds must be provided and non-empty"),
        (req(), "set either prompt or messages"),
        (req(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (req(prompt="hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
        (req(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (req(prompt="hi", sampling=pb.SamplingParams(max_tokens=10**9)), "cannot be greater than max_model_len"),
        (req(prompt="hi", sampling=pb.SamplingParams(temperature=float("nan"))), "finite"),
        (req(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=0)), "repetition_penalty"),
        (req(prompt="hi", sampling=pb.SamplingParams(min_p=2)), "min_p"),
        (req(prompt="hi", deadline_ms=-5), "deadline_ms"),
        (req(prompt="hi", request_id="x" * 200), "request_id"),
        (req(messages=pb.ChatMessages()), "empty conversation"),
        (b"\xff\xff\xff", "malformed"),
        (req(prompt="hi") + b"\xa8\x06\x01", "unknown field"),
        (req(prompt="hi", vtoken=pb.VTokenOptions(budget=-1)), "vtoken.budget"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(state, raw, needle):
    with pytest.raises(BadRequest) as e:
        rendered(state, raw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_good_request_renders_as_vllm_renders_it(state):
    """A prompt and a chat, rendered with the model's tokenizer and template, sampling as vLLM's SamplingParams
    (DELTA: the door streams what each step adds), the client's id kept for the door."""
    from vllm.sampling_params import RequestOutputKind

    tok = state.openai_serving_completion.renderer.tokenizer
    r = rendered(state, req(prompt="hello", request_id="mine", sampling=pb.SamplingParams(max_tokens=8, temperature=0)))
    assert r.prompt["prompt_token_ids"] == tok.encode("hello") and r.params.max_tokens == 8
    assert r.params.temperature == 0 and r.params.output_kind == RequestOutputKind.DELTA
    assert r.context.door == "grpc" and r.context.client_id == "mine" and r.context.eviction.extra_args is None
    chat = req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    r = rendered(state, chat)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert r.prompt["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    assert r.params.max_tokens == CFG.engine.max_model_len - len(r.prompt["prompt_token_ids"])  # vLLM's default


def test_vtoken_options_from_the_proto_keep_counts_whole_and_unset_fields_absent():
    from cluster.doors.grpc_requests import options_from_proto

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
    from cluster.serving.requests import vtoken_options

    with pytest.raises(BadRequest) as e:
        vtoken_options(options, served)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(e.value.param + ":"), "the 400's param names the field its message starts with"


def test_accepted_eviction_options_become_request_args_and_bound_the_block_estimate():
    from cluster.serving.requests import vtoken_options
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


def test_the_grpc_doors_eviction_options_reach_the_context(state):
    r = rendered(state, req(prompt="hi", vtoken=pb.VTokenOptions(policy="random", budget=0.5)))
    assert r.context.eviction.extra_args == {"vtoken": {"policy": "random", "budget": 0.5}}


# ------------------------------------------------------------------------------ the remote engine client
class _Stream:
    """A dispatcher whose stream yields the given chunks, and which admits as Dispatcher.admit does."""

    def __init__(self, chunks):
        self.chunks, self.inflight = chunks, 0

    async def stream(self, req, door):
        from cluster.serving.dispatch import Delta

        for c in self.chunks:
            yield Delta("r0", c)

    def admit(self, door):
        import contextlib

        @contextlib.contextmanager
        def slot():
            self.inflight += 1
            try:
                yield
            finally:
                self.inflight -= 1

        return slot()


def _client(chunks):
    from cluster.serving.frontend import frontend
    from cluster.serving.remote_engine import RemoteEngineClient

    return RemoteEngineClient(CFG, frontend(CFG).vllm_config, _Stream(chunks))


def test_the_engine_arguments_and_cache_salt_cross_as_the_serving_layer_set_them():
    """reasoning_ended=False is an answer, not an absence (it was dropped: False == 0); a salted prompt keeps its
    salt for the replica's prefix cache and follows no prefix in placement."""
    import asyncio

    from vllm import SamplingParams

    from cluster.serving.requests import RequestContext

    eng = _client([])
    prompt = {"type": "token", "prompt_token_ids": list(range(5, 100)), "cache_salt": "tenant-a"}
    kw = {"reasoning_ended": False, "priority": 0, "reasoning_parser_kwargs": None}
    v = asyncio.run(eng._valid(prompt, SamplingParams(max_tokens=4), "r", RequestContext(), "r-1", kw))
    assert v.engine_kwargs == {"reasoning_ended": False, "cache_salt": "tenant-a"} and v.prefix_hashes == ()
    assert (v.request_id, v.client_id, v.max_tokens, v.n) == ("r-1", "r", 4, 1)  # one id to the replica, set once
    salted = {**prompt, "cache_salt": None}
    plain = asyncio.run(eng._valid(salted, SamplingParams(max_tokens=4), "r", RequestContext(), "r-2", {}))
    assert plain.engine_kwargs == {} and len(plain.prefix_hashes) == 95 // CFG.engine.block_size


def test_a_whole_answer_of_n_sequences_is_in_index_order_whatever_order_they_finished_in():
    """FINAL_ONLY: vLLM's RequestOutput.add appends sequences as they arrive; AsyncLLM answers in index order, and
    completions number choices by position."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from actors.wire import Chunk, Seq

    chunks = [Chunk((Seq(1, " b", (7,), finish_reason="length"),)),
              Chunk((Seq(0, " a", (6,), finish_reason="length"),), finished=True)]  # fmt: skip
    params = SamplingParams(max_tokens=1, n=2, output_kind=RequestOutputKind.FINAL_ONLY)

    async def run():
        eng = _client(chunks)
        return [o async for o in eng.generate({"type": "token", "prompt_token_ids": [5, 6]}, params, "r")]

    (out,) = asyncio.run(run())
    assert [(o.index, o.text) for o in out.outputs] == [(0, " a"), (1, " b")]


def test_a_generate_after_its_doors_answer_is_admitted_on_its_own_until_it_ends():
    """A background Responses request runs on after the door's answer (and its admission) ended: its generate holds
    a slot of max_inflight of its own while it runs."""
    from vllm import SamplingParams

    from actors.wire import Chunk, Seq
    from cluster.serving.requests import CONTEXT, Live, RequestContext

    async def run():
        eng = _client([Chunk((Seq(0, " a", (6,), finish_reason="length"),), finished=True)])
        live = Live()
        live.door_done = True
        CONTEXT.set(RequestContext(live=live))
        seen = []
        async for _ in eng.generate({"type": "token", "prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1), "r"):
            seen.append((eng.dispatcher.inflight, live.n))
        return seen, eng.dispatcher.inflight, live.n, live.idle.is_set()

    seen, inflight, n, idle = asyncio.run(run())
    assert seen == [(1, 1)] and inflight == 0 and n == 0 and idle


def test_engine_extra_config_dicts_and_the_reasoning_parser_reach_the_gateways_config_as_the_replicas():
    """serve.yaml's engine.extra.structured_outputs_config is a dict; with a reasoning parser vLLM's engine args set
    attributes on it (an AttributeError in the gateway and every replica, before); the gateway's config carries the
    replicas' reasoning_config (thinking_token_budget was refused at the door)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from cluster.config import engine_args
    from cluster.serving.frontend import frontend
    from vtoken.vllm_adapter.engine import config_objects

    cfg = parse_config({"model": "fake", "engine": {"kind": "fake", "reasoning_parser": "granite",
                                                    "extra": {"structured_outputs_config": {"backend": "xgrammar"}}},
                        "gateway": {"port": 0, "http_port": 0}})  # fmt: skip
    vc = frontend(cfg).vllm_config
    assert vc.structured_outputs_config.backend == "xgrammar"
    assert vc.structured_outputs_config.reasoning_parser == "granite" == vc.reasoning_config.reasoning_parser
    replica = AsyncEngineArgs(model=str(cfg.model_folder()), **config_objects(engine_args(cfg)))  # make_async_llm
    assert replica.create_structured_outputs_config().reasoning_parser == "granite"
