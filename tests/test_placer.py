"""Placement in the gateway (cluster/placement/placer.py) against the controller's own: the same choices for a burst
placed between two refreshes, every placement counted by the controller, ``prefix`` from copies of the controller's
prefix indexes, and the controller still placing when the gateway's copy cannot (too old, no replica left)."""

from __future__ import annotations

import asyncio
import time

from actors.report import empty_pool, unreported
from cluster.config import parse_config
from cluster.control.controller import Controller, ReplicaState
from cluster.control.replica_status import ReplicaStatus
from cluster.placement.placer import Placer
from cluster.placement.prefix_index import with_prefix


class Remote:
    """A controller's methods called as a Ray actor's are (``handle.method.remote(...)``), in this event loop: each
    call a task, run in the order of the calls."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        class Method:
            @staticmethod
            def remote(*args):
                return asyncio.ensure_future(method(*args))

        return Method


def controller(strategy: str = "weighted") -> Controller:
    cfg = {"model": "fake", "engine": {"kind": "fake"}, "placement": {"strategy": strategy}}
    ctl = Controller(parse_config(cfg).model_dump())
    now = time.monotonic()
    for name, running in [("a", 2), ("b", 1)]:
        pool = empty_pool(32)._replace(free_blocks=40, total_blocks=64, running=running, tokens_to_go=100 * running)
        ctl.replicas[name] = ReplicaState(
            name, handle=f"handle-{name}", state="healthy", report=unreported(name)._replace(pool=pool),
            reported_at=now,
        )  # fmt: skip
    return ctl


async def refreshed(placer: Placer) -> None:
    """A refresh done (a placement that finds the copy older than refresh_s starts one)."""
    await placer._refresh()
    assert placer.at is not None


def test_a_burst_between_two_refreshes_goes_where_the_controller_would_send_it():
    """Three requests placed before the controller's views count any of them: the gateway counts its own promises,
    so they spread as the controller's own placements do (test_controller's burst: b, a, b), and the controller
    counts each one. Negative control: a gateway that forgot its own promises sends the whole burst to b."""

    async def burst(forget: bool):
        ctl = controller()
        placer = Placer(Remote(ctl), refresh_s=3600)
        await refreshed(placer)
        names = []
        for i in range(3):
            name, handle = await placer.place(f"q{i}", 4, [], 100)
            assert handle == f"handle-{name}"
            names.append(name)
            if forget:
                placer.mine.clear()
        await asyncio.sleep(0.01)  # the promises reach the controller
        counted = {rid: p.replica for rid, p in ctl.promises.items()}
        await placer.aclose()
        return names, counted, dict(ctl.placements)

    names, counted, placements = asyncio.run(burst(forget=False))
    assert names == ["b", "a", "b"]
    assert counted == {"q0": "b", "q1": "a", "q2": "b"}
    assert placements == {("weighted", "b"): 2, ("weighted", "a"): 1}
    assert asyncio.run(burst(forget=True))[0] == ["b", "b", "b"]


def test_views_that_count_a_promise_replace_the_gateways_own_count():
    """After a refresh whose views count the gateway's promises, it stops adding them itself (no double count): the
    next placement sees what the controller's own next placement would see."""

    async def run():
        ctl = controller()
        placer = Placer(Remote(ctl), refresh_s=3600)
        await refreshed(placer)
        for i in range(3):
            await placer.place(f"q{i}", 4, [], 100)
        assert len(placer.mine) == 3
        await asyncio.sleep(0.01)
        await refreshed(placer)
        assert placer.mine == {}
        views = {v.name: (v.promised, v.pending, v.tokens_to_go) for v in placer.views}
        assert views == {v.name: (v.promised, v.pending, v.tokens_to_go) for v in ctl._views()}
        assert views == {"a": (4, 1, 300), "b": (8, 2, 300)}
        theirs = ctl.strategy.choose(ctl._views(), 4).name  # what the controller would choose now
        ours = (await placer.place("q3", 4, [], 100))[0]
        await placer.aclose()
        return ours, theirs

    ours, theirs = asyncio.run(run())
    assert ours == theirs


def test_the_gateway_waits_for_a_copy_and_the_controller_places_what_the_gateway_cannot():
    """A request that finds no copy, or one older than max_age_s, waits for a new one (one strategy object per
    gateway); None (the controller places it) when no copy comes, when every replica in the copy was tried. A replica
    that died under a request gets nothing more until a copy shows it."""
    import ray

    async def run():
        ctl = controller()
        placer = Placer(Remote(ctl), refresh_s=0.01, max_age_s=0.05)
        assert (await placer.place("first", 1, [], 1))[0] in ("a", "b") and placer.at is not None
        assert await placer.place("x", 1, ["a", "b"], 1) is None
        placer.lost("b")
        assert (await placer.place("y", 1, [], 1))[0] == "a"
        await asyncio.sleep(0.06)
        ctl.replicas["a"].state = ReplicaStatus.DEAD
        assert (await placer.place("z", 1, [], 1))[0] == "b"  # the copy it waited for
        await placer.aclose()

        class Down:
            async def placement_state(self, *args):
                raise ray.exceptions.GetTimeoutError("the controller is restarting")

        down = Placer(Remote(Down()), refresh_s=0.01, max_age_s=0.05)
        assert await down.place("d", 1, [], 1) is None and down.at is None

    asyncio.run(run())


def test_a_promise_after_its_request_was_admitted_or_ended_is_not_counted():
    """Promises travel without a reply, beside the request itself: one that reaches the controller after a report
    counted the request's admission there, or after the request's end, would count its blocks twice until it
    expires. A promise to a replica that stopped serving is void like the others there."""
    from actors.report import ReplicaReport

    ctl = controller()
    pool = empty_pool(32)._replace(free_blocks=40, total_blocks=64, admitted=("early",))
    asyncio.run(ctl.report("a", ReplicaReport("a", "", True, False, 0, time.time(), pool)))
    asyncio.run(ctl.finished("done", "gw", 2))  # the gateway's 2nd promise: not heard of yet
    asyncio.run(ctl.finished("old", "gw", 0))
    ctl.replicas["b"].state = ReplicaStatus.DEAD
    for seq, (rid, name) in enumerate([("early", "a"), ("done", "a"), ("gone", "b"), ("ok", "a")], 1):
        asyncio.run(ctl.promise("gw", seq, rid, name, 4, 10, "weighted"))
    assert set(ctl.promises) == {"ok"} and ctl.acked["gw"] == 4
    ctl.replicas["b"].state = ReplicaStatus.HEALTHY
    asyncio.run(ctl.promise("gw", 5, "early", "b", 4, 10, "weighted"))  # admitted on "a" only: a retry on "b"
    assert set(ctl.promises) == {"ok", "early"} and ctl.promises["early"].replica == "b"
    # only such late requests are remembered: an ordinary request's end (its promise heard of) is not
    asyncio.run(ctl.finished("ok", "gw", 4))
    assert list(ctl.settled) == [("early", "a"), ("done", "")]


def test_the_gateway_places_from_views_unless_told_not_to():
    from cluster.serving.dispatch import Dispatcher

    cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}})
    assert cfg.gateway.placement_refresh_s > 0
    assert Dispatcher(cfg, object()).placer is not None
    off = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"placement_refresh_s": 0}})
    assert Dispatcher(off, object()).placer is None and Dispatcher(cfg, None).placer is None


def test_prefix_places_in_the_gateway_from_copies_of_the_controllers_indexes():
    """Under ``prefix`` the gateway places from copies of the controller's prefix indexes, brought up to date by each
    refresh with the changes since (only what changed travels), and chooses as the controller would: a prompt goes
    where its blocks are, a removal there moves the next one, and a strategy that reads no prefixes drops the copies.
    Negative control: the same gateway without its copies sends the prompt elsewhere."""
    from actors.report import PrefixDelta
    from vtoken.prefix_hash import prefix_hashes

    prompt = prefix_hashes(list(range(64)), 16)  # 4 blocks

    def report(ctl, name, delta):
        r = ctl.replicas[name].report._replace(healthy=True, prefix=delta)
        return ctl.report(name, r)

    async def run(forget: bool):
        ctl = controller("prefix")
        placer = Placer(Remote(ctl), refresh_s=3600)
        await report(ctl, "a", PrefixDelta(1, prompt))  # "a" is the busier one: weighted alone sends to "b"
        await refreshed(placer)
        assert set(placer.prefix) == {"a"} and list(placer.prefix["a"].hashes) == list(ctl.prefix["a"].hashes)
        if forget:
            placer.prefix.clear()
        theirs = ctl.strategy.choose(with_prefix(ctl._views(), ctl.prefix, prompt), 4).name
        first = (await placer.place("q1", 4, [], 100, prompt))[0]
        await report(ctl, "a", PrefixDelta(2, (), prompt[:1]))  # its first block went: nothing left to read there
        await report(ctl, "b", PrefixDelta(1, prompt))
        asked = []
        ctl_state = ctl.placement_state

        async def placement_state(*args):
            asked.append(args[2])
            st = await ctl_state(*args)
            asked.append(st.prefix)
            return st

        ctl.placement_state = placement_state
        await refreshed(placer)
        second = (await placer.place("q2", 4, [], 100, prompt))[0]
        await placer.aclose()
        return theirs, first, second, asked, placer, ctl

    theirs, first, second, asked, placer, ctl = asyncio.run(run(forget=False))
    assert first == theirs == "a" and second == "b"
    have, sent = asked
    assert set(have) == {"a"}  # the copies it holds, by (epoch, version)
    assert sent["a"].full is None and sent["a"].changes == (((), prompt[:1]),)  # "a": its one change
    assert sent["b"].full == prompt  # "b": new, whole
    assert {n: list(c.hashes) for n, c in placer.prefix.items()} == {n: list(i.hashes) for n, i in ctl.prefix.items()}

    async def switch():
        await ctl.set_placement("weighted")
        ctl.placement_state = Controller.placement_state.__get__(ctl)
        await refreshed(placer)
        return placer.prefix

    assert asyncio.run(switch()) == {}
    assert asyncio.run(run(forget=True))[1] == "b"
