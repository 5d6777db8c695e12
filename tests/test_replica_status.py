"""The controller as a state machine: ReplicaStatus, its table of transitions, and the one function that makes
them. Every allowed transition succeeds and is logged, every other one raises; a replica that stops serving
keeps no promise, whichever way it leaves (driven through the controller's own paths). No Ray: the replicas'
actor handles are small fakes."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

import pytest

from actors.report import ReplicaReport, empty_pool
from cluster.config import parse_config
from cluster.control.controller import Controller, ReplicaState
from cluster.control.replica_status import TRANSITIONS, InvalidTransition, ReplicaStatus
from cluster.control.snapshot import replica_views, take_snapshot
from cluster.control.status import cluster_status, to_proto

ALL = list(ReplicaStatus)
ALLOWED = [(a, b) for a in ALL for b in sorted(TRANSITIONS[a])]
DISALLOWED = [(a, b) for a, b in itertools.product(ALL, ALL) if b not in TRANSITIONS[a]]


class Method:
    def __init__(self, fn):
        self.remote = fn


class Handle:
    """A replica actor's handle: ``start`` returns an incarnation or raises, ``ping`` answers or hangs,
    ``drain`` waits for ``release`` (so a test can look at a replica while it drains)."""

    def __init__(self, start_error: Exception | None = None, answers: bool = True):
        self.release = asyncio.Event()

        async def start():
            if start_error is not None:
                raise start_error
            return "i2"

        async def ping():
            if not answers:
                await asyncio.sleep(60)
            return {"ready": True}

        async def drain(timeout_s):
            await self.release.wait()

        async def shutdown():
            return None

        async def where():
            return "127.0.0.1", "node", 1

        self.start, self.ping, self.drain, self.shutdown, self.where = map(
            Method, (start, ping, drain, shutdown, where)
        )


class Records(logging.Handler):
    """The controller's log lines (pytest runs here with ``-p no:logging``, so no caplog)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture
def records():
    h, logger = Records(), logging.getLogger("vtoken.controller")
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    yield h
    logger.removeHandler(h)
    logger.setLevel(old)


def controller(**placement) -> Controller:
    return Controller(parse_config({"model": "fake", "engine": {"kind": "fake"}, "placement": placement}).model_dump())


def report(name: str, healthy: bool = True, incarnation: str = "i1", free: int = 30) -> ReplicaReport:
    pool = empty_pool(32)._replace(free_blocks=free, total_blocks=64)
    return ReplicaReport(name, incarnation, healthy, False, 0, time.time(), pool, "" if healthy else "engine died")


def with_replicas(ctl: Controller, *states: tuple[str, ReplicaStatus], handle=None) -> None:
    for name, state in states:
        ctl.replicas[name] = ReplicaState(
            name, handle or Handle(), state=state, report=report(name), reported_at=time.monotonic()
        )


# ------------------------------------------------------------------------------ the enum and its table
def test_the_values_are_the_strings_status_metrics_and_the_capacity_stream_have_always_carried():
    assert [s.value for s in ReplicaStatus] == ["starting", "healthy", "dead", "draining", "failed"]
    assert (
        ReplicaStatus("healthy") is ReplicaStatus.HEALTHY
        and ReplicaStatus.DEAD == "dead"
        and json.dumps(ReplicaStatus.DRAINING) == '"draining"'
    )
    assert [s for s in ReplicaStatus if s.serving()] == [ReplicaStatus.HEALTHY]
    assert {s for s in ReplicaStatus if not s.takes_reports()} == {ReplicaStatus.DRAINING, ReplicaStatus.FAILED}
    assert set(TRANSITIONS) == set(ReplicaStatus) and not TRANSITIONS[ReplicaStatus.DRAINING]
    with pytest.raises(ValueError):
        ReplicaState("r", handle=None, state="healty")


@pytest.mark.parametrize("frm, to", ALLOWED, ids=[f"{a}->{b}" for a, b in ALLOWED])
def test_every_allowed_transition_succeeds_is_logged_and_leaves_no_promise_outside_serving(frm, to, records):
    ctl = controller()
    with_replicas(ctl, ("r", frm), ("other", ReplicaStatus.HEALTHY))
    ctl.promises = {"q": ctl_promise("r"), "p": ctl_promise("other")}
    ctl.lifecycle.transition(ctl.replicas["r"], to, "because of a test")
    assert ctl.replicas["r"].state is to
    assert ("q" in ctl.promises) == to.serving() and "p" in ctl.promises  # only its own promises go
    assert any(f"replica r: {frm} -> {to}: because of a test" in line for _, line in records.lines), records.lines


@pytest.mark.parametrize("frm, to", DISALLOWED, ids=[f"{a}->{b}" for a, b in DISALLOWED])
def test_every_other_transition_raises_a_clear_error_and_changes_nothing(frm, to, records):
    ctl = controller()
    with_replicas(ctl, ("r", frm))
    ctl.promises = {"q": ctl_promise("r")}
    with pytest.raises(InvalidTransition, match=f"replica r: {frm} -> {to} is not a valid transition") as e:
        ctl.lifecycle.transition(ctl.replicas["r"], to, "because of a test")
    assert "(because of a test)" in str(e.value) and "it may go to" in str(e.value)
    assert ctl.replicas["r"].state is frm and "q" in ctl.promises and not records.lines


def ctl_promise(replica: str):
    from cluster.control.controller import Promise

    return Promise(replica, 8, time.monotonic())


def test_death_and_recovery_times_are_kept_by_the_transition():
    ctl = controller()
    with_replicas(ctl, ("r", ReplicaStatus.HEALTHY))
    st = ctl.replicas["r"]
    ctl.lifecycle.transition(st, ReplicaStatus.DEAD, "call failed")
    died = st.died_at
    ctl.lifecycle.transition(st, ReplicaStatus.DEAD, "its engine died again")
    assert st.died_at == died  # the first death counts
    ctl.lifecycle.transition(st, ReplicaStatus.HEALTHY, "reported healthy")
    assert st.died_at is None and len(ctl.lifecycle.recoveries) == 1 and ctl.lifecycle.recoveries[0] >= 0


# ------------------------------------------------------------------------------ promises, through the controller
async def _healthy_with_a_promise(ctl: Controller, handle: Handle) -> ReplicaState:
    with_replicas(ctl, ("a", ReplicaStatus.STARTING), handle=handle)
    await ctl.report("a", report("a"))  # starting -> healthy
    assert ctl.replicas["a"].state is ReplicaStatus.HEALTHY
    assert (await ctl.place("q", 8))[0] == "a" and "q" in ctl.promises
    return ctl.replicas["a"]


async def call_failed(ctl, st, monkeypatch):
    await ctl.mark_failed("a", "the gateway's call failed")


async def engine_died(ctl, st, monkeypatch):
    monkeypatch.setattr(ctl.lifecycle, "_restart_process", lambda st: None)  # Ray's part
    await ctl.report("a", report("a", healthy=False))  # the same incarnation: only the transition voids


async def silent(ctl, st, monkeypatch):
    st.handle = Handle(answers=False)
    st.reported_at = st.alive_at = time.monotonic() - 10
    ctl.lifecycle.probe_silent(time.monotonic())
    await st.probe


async def start_failed(ctl, st, monkeypatch):
    st.handle = Handle(start_error=RuntimeError("too small a pool"))
    await ctl.lifecycle._start_replica(st)


async def drained(ctl, st, monkeypatch):
    monkeypatch.setattr("cluster.control.lifecycle.ray.kill", lambda *a, **k: None)
    ctl.target = 0
    ctl._reconcile()  # scale-in: drains it in the background
    await asyncio.sleep(0)
    assert st.state is ReplicaStatus.DRAINING and "a" in ctl.replicas  # still draining: the promise is gone already
    return st.handle.release


PATHS = {
    "healthy->dead (a call failed)": (call_failed, ReplicaStatus.DEAD),
    "healthy->dead (its engine died)": (engine_died, ReplicaStatus.DEAD),
    "healthy->dead (silent, no answer to a ping)": (silent, ReplicaStatus.DEAD),
    "healthy->failed (a restart failed to start)": (start_failed, ReplicaStatus.FAILED),
    "healthy->draining (scale-in)": (drained, ReplicaStatus.DRAINING),
}


@pytest.mark.parametrize("path", PATHS)
def test_a_promise_is_voided_on_every_path_out_of_serving(path, monkeypatch):
    leave, to = PATHS[path]

    async def go():
        ctl = controller(dead_after_s=0.3)
        st = await _healthy_with_a_promise(ctl, Handle())
        release = await leave(ctl, st, monkeypatch)
        assert st.state is to
        assert "q" not in ctl.promises, f"{path}: the promise outlived serving"
        assert await ctl.place("p", 1) is None  # and nothing is placed there
        if release is not None:
            release.set()
            while ctl._tasks:
                await asyncio.sleep(0.01)
            assert "a" not in ctl.replicas

    asyncio.run(go())


def test_every_way_out_of_healthy_in_the_table_has_a_path_above():
    assert set(TRANSITIONS[ReplicaStatus.HEALTHY]) == {to for _, to in PATHS.values()}


# ------------------------------------------------------------------------------ one snapshot for all readers
def test_the_autoscaler_placement_and_status_read_the_same_snapshot(monkeypatch):
    ctl = controller(stale_after_s=3)
    with_replicas(
        ctl,
        ("a", ReplicaStatus.HEALTHY),
        ("b", ReplicaStatus.HEALTHY),
        ("c", ReplicaStatus.DEAD),
        ("d", ReplicaStatus.DRAINING),
        ("e", ReplicaStatus.STARTING),
    )
    ctl.replicas["b"].reported_at -= 10  # stale
    asyncio.run(ctl.place("q", 8))
    seen = []
    monkeypatch.setattr(ctl.autoscaler, "decide", lambda now, replicas, current, limit: seen.append(replicas))
    monkeypatch.setattr(ctl, "_limit", lambda: 4)
    ctl._autoscale(time.monotonic())
    snap = take_snapshot(ctl)
    status = cluster_status(snap)
    assert seen == [replica_views(snap, 3)] == [ctl._views()]
    rows = {r["name"]: r for r in status["replicas"]}
    assert [v.name for v in seen[0]] == [n for n, r in rows.items() if r["state"] == "healthy"] == ["a", "b"]
    for v in seen[0]:
        assert (v.free_blocks, v.promised) == (rows[v.name]["free_blocks"], rows[v.name]["promised_blocks"])
    assert [v.stale for v in seen[0]] == [False, True]
    assert all(type(r["state"]) is str for r in status["replicas"]) and status["totals"]["state"] == "2/5 healthy"
    assert [r.state for r in to_proto(status).replicas] == ["healthy", "healthy", "dead", "draining", "starting"]
