"""A request's work (cluster/serving/work.py), admission by it (Dispatcher.admit), the parse stage's bound, and
placement's refusal of a request no pool can ever hold (placement.check_fits): no Ray, no server. The doors' end-to-end
behaviour is in tests/test_door_abuse.py."""

from __future__ import annotations

import pytest

from cluster.config import parse_config
from cluster.placement.strategies import ReplicaView, TooLarge, check_fits
from cluster.serving.dispatch import Dispatcher, Refused
from cluster.serving.requests import BadRequest
from cluster.serving.work import RENDER, WorkTally, request_work

CFG = parse_config({"model": "fake", "engine": {"kind": "fake"}})
G = CFG.gateway
CHAT = "/v1/chat/completions"


def test_n_and_best_of_over_max_n_are_refused_naming_the_field():
    assert request_work(CHAT, {"n": G.max_n, "max_tokens": 4}, 100, G, 512).n == G.max_n
    for key in ("n", "best_of"):
        with pytest.raises(BadRequest) as e:
            request_work("/v1/completions", {"prompt": "hi", key: G.max_n + 1}, 100, G, 512)
        assert e.value.param == key and "gateway.max_n" in str(e.value)
    # the native generate route keeps its sampling apart
    with pytest.raises(BadRequest) as e:
        request_work("/inference/v1/generate", {"sampling_params": {"n": 16384}}, 100, G, 512)
    assert e.value.param == "n"


def test_n_times_prompts_times_max_tokens_over_the_ceiling_names_the_field_it_came_from():
    body = {"prompt": ["hi"] * 1024, "n": 128, "max_tokens": 100}
    with pytest.raises(BadRequest) as e:
        request_work("/v1/completions", body, 10_000, G, 512)
    assert e.value.param == "max_tokens" and "13107200" in str(e.value)
    chat = {"messages": [], "n": 128, "max_completion_tokens": 10_000}
    with pytest.raises(BadRequest) as e:
        request_work(CHAT, chat, 100, G, 20_000)
    assert e.value.param == "max_completion_tokens"
    # no max tokens: the context's length stands for them, and n is what the client can lower
    with pytest.raises(BadRequest) as e:
        request_work(CHAT, {"messages": [], "n": 128}, 100, G, 1 << 14)
    assert e.value.param == "n"


def test_a_prompt_list_and_a_batch_count_each_prompt_and_each_sequence_at_least_a_block():
    w = request_work("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}, 50, G, 512, 32)
    assert (w.prompts, w.n, w.tokens) == (3, 2, 2 * 50 + 2 * 3 * 32)
    ids = request_work("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8}, 40, G, 512)
    assert ids.prompts == 1  # one prompt of token ids, not three prompts
    batch = request_work("/v1/chat/completions/batch", {"messages": [[{}], [{}]], "max_tokens": 8}, 40, G, 512)
    assert batch.prompts == 2
    # the negative control of the block minimum: without it, 1,024 one-token prompts x 128 weigh 131,072
    tiny = {"prompt": ["x"] * 1024, "n": 128, "max_tokens": 1}
    assert request_work("/v1/completions", tiny, 8_000, G, 512, 1).prompts == 1024  # passes its ceiling
    with pytest.raises(BadRequest):
        request_work("/v1/completions", tiny, 8_000, G, 512, 32)


def test_routes_that_only_render_weigh_their_body_and_odd_bodies_pass_to_vllms_checks():
    for path in sorted(RENDER):
        assert request_work(path, {"prompt": "x" * 900, "n": 10**6}, 900, G, 512).tokens == 900
    assert request_work(CHAT, ["not", "an", "object"], 17, G, 512).tokens == 17
    assert request_work(CHAT, {"n": "many", "max_tokens": True}, 30, G, 512).n == 1  # vLLM refuses the types


def test_the_tally_adds_each_rendered_prompt_and_refuses_past_the_ceiling():
    tally = WorkTally(1000, block_size=32)
    tally.add(1, 10, 5)  # one block at least
    assert tally.tokens == 32
    tally.add(2, 400, 50)
    assert tally.tokens == 932
    with pytest.raises(BadRequest) as e:
        tally.add(1, 60, 10)
    assert e.value.param == "max_tokens"


def test_admission_counts_work_and_always_admits_a_request_alone():
    cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"max_inflight_tokens": 1000}})
    d = Dispatcher(cfg, None)
    with d.admit("http", 5000):  # alone: over the limit, admitted all the same
        assert d.inflight_tokens == 5000
        with pytest.raises(Refused) as e:
            with d.admit("http", 1):
                pass
        assert e.value.code == "resource_exhausted" and "max_inflight_tokens" in e.value.message
    with d.admit("grpc", 600):
        with d.admit("http", 400):
            assert (d.inflight, d.inflight_tokens) == (2, 1000)
        with pytest.raises(Refused):
            with d.admit("http", 401):
                pass
    assert (d.inflight, d.inflight_tokens) == (0, 0)


def test_the_parse_stage_holds_at_most_max_parse_pending_and_ends_once():
    cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"max_parse_pending": 2}})
    d = Dispatcher(cfg, None)
    a, b = d.parse_stage("http"), d.parse_stage("grpc")
    with pytest.raises(Refused) as e:
        d.parse_stage("http")
    assert e.value.code == "unavailable" and "max_parse_pending" in e.value.message
    a.end()
    a.end()  # idempotent: a request that rendered and then ended frees its place once
    assert d.parsing == 1 and a.done.is_set() and not b.done.is_set()
    d.parse_stage("http").end()
    b.end()
    assert d.parsing == 0


def test_a_request_no_pool_can_ever_hold_is_refused_with_both_numbers():
    views = [ReplicaView("a", free_blocks=0, total_blocks=64), ReplicaView("b", free_blocks=10, total_blocks=128)]
    check_fits(views, 128)  # fits the larger pool once it is free: placed (and waits there), not refused
    with pytest.raises(TooLarge) as e:
        check_fits(views, 129)
    assert "129" in str(e.value) and "128" in str(e.value)
    check_fits([ReplicaView("new", free_blocks=0, total_blocks=0)], 10**6)  # no pool reported yet: not judged


def test_large_bodies_take_turns_to_render_so_a_thread_is_left_to_small_ones():
    """parse_workers - 1 large bodies render at once (two 900 KB /tokenize requests took both renderer threads and
    a chat waited 0.9 s behind them); a small body never waits; a stage that ends while it waits gives its turn on.
    Negative control: with parse_workers 3, two large ones render together."""
    import asyncio

    from cluster.serving.dispatch import LARGE_BODY

    async def main(workers: int) -> tuple[bool, bool]:
        cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"parse_workers": workers}})
        d = Dispatcher(cfg, None)
        a, b = d.parse_stage("http", LARGE_BODY + 1), d.parse_stage("grpc", LARGE_BODY + 1)
        await asyncio.wait_for(a.turn(), 1)
        await asyncio.wait_for(d.parse_stage("http", 100).turn(), 1)  # small: at once
        waiting = asyncio.ensure_future(b.turn())
        await asyncio.sleep(0.05)
        b_blocked = not waiting.done()
        c = d.parse_stage("http", LARGE_BODY + 1)
        a.end()  # a rendered: its turn goes on
        await asyncio.wait_for(waiting, 1)
        c_waiter = asyncio.ensure_future(c.turn())
        await asyncio.sleep(0.05)
        c.end()  # c ended (its client went away) while it waited: it holds no turn
        b.end()
        await asyncio.wait_for(c_waiter, 1)
        await asyncio.wait_for(d.parse_stage("http", LARGE_BODY + 1).turn(), 1)  # the turn is free again
        return b_blocked, d._large._value == 0

    assert asyncio.run(main(2)) == (True, True)
    assert asyncio.run(main(3))[0] is False
