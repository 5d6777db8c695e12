"""The replica and the gateway's error mapping without Ray: engine failures become one-line errors with a
code (the traceback stays in the log), a dead engine is noticed once, replaced, and placement avoids the
replica meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from actors.engines import ABORTED, Chunk, FakeEngine, GenerateSpec
from actors.replica import Replica
from actors.report import ReplicaReport, empty_pool
from cluster.config import parse_config
from cluster.control.controller import Controller, ReplicaState
from cluster.control.replica_status import ReplicaStatus
from cluster.serving.dispatch import failure

Code = grpc.StatusCode


class _Remote:
    """``obj.method.remote(...)`` of a Ray handle, answered at once in this event loop."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut


class StubController:
    def __init__(self):
        self.reports: list[ReplicaReport] = []
        self.report = _Remote(lambda name, r: self.reports.append(r))


class Unanswered(FakeEngine):
    """A pool report under way when vLLM's EngineCore dies is never answered."""

    hang = False

    async def pool_report(self):
        if self.hang:
            await asyncio.Event().wait()
        return await super().pool_report()


class Broken(FakeEngine):
    async def generate(self, spec):
        raise RuntimeError("boom in /srv/secret/path.py at 10.0.0.7")
        yield  # an async generator, like the real ones


async def _collect(replica, spec):
    return [c async for c in replica.generate(spec)]


def test_an_unexpected_engine_error_is_internal_and_its_traceback_stays_in_the_log(caplog):
    async def go():
        r = Replica("r1", Broken)
        await r.start()
        return await _collect(r, GenerateSpec("rid-42", [1, 2, 3], {"max_tokens": 4}, 4)), r

    with caplog.at_level(logging.ERROR, logger="vtoken.replica"):
        chunks, replica = asyncio.run(go())
    assert len(chunks) == 1 and chunks[0].code == "internal", chunks
    assert "secret" not in chunks[0].error and "10.0.0.7" not in chunks[0].error and "\n" not in chunks[0].error
    assert "rid-42" in caplog.text and caplog.records[-1].exc_info  # the traceback is in the server log
    assert not replica.inflight


@pytest.mark.parametrize(
    "chunk, code, needle",
    [
        (Chunk.failed("invalid_argument", "stop cannot contain an empty string.\nmore"), Code.INVALID_ARGUMENT, "stop"),
        (Chunk.failed("unavailable", "replica r is draining"), Code.UNAVAILABLE, "draining"),
        (Chunk.failed("internal", "replica r failed"), Code.INTERNAL, "failed"),
        (ABORTED, Code.UNAVAILABLE, "aborted by replica r"),
        (None, Code.UNAVAILABLE, "aborted by replica r"),  # the stream stopped before its finished chunk
    ],
)
def test_how_a_stream_the_server_ended_reaches_the_client(chunk, code, needle):
    from vllm.entrypoints.serve import create_error_response

    from cluster.serving.dispatch import Refused
    from cluster.serving.remote_engine import vllm_error

    got, why = failure(chunk, "r")
    assert Code[got.upper()] == code and needle in why and "\n" not in why  # the gRPC door's status
    status = create_error_response(vllm_error(Refused(got, why))).error.code  # HTTP's, through vLLM's mapping
    assert status == {"INVALID_ARGUMENT": 400, "UNAVAILABLE": 503, "INTERNAL": 500}[code.name]


def test_a_dead_engine_is_logged_once_and_reported_so_the_controller_restarts_the_replica(caplog):
    """The engine dies under a live replica: the request in flight ends ``unavailable`` (the gateway places
    it again if nothing streamed), new ones are refused the same way, every report from then on says unhealthy
    with the reason (the controller stops placing there and restarts the process), and the death is logged
    once however many report polls meet it."""
    built: list[Unanswered] = []

    def factory():
        built.append(Unanswered(total_blocks=8, token_delay_s=0.01))
        return built[-1]

    async def go():
        ctl = StubController()
        r = Replica("r1", factory, ctl, report_interval_s=0.05, poll_s=0.01)
        await r.start()
        stream = r.generate(GenerateSpec("a", [1] * 10, {"max_tokens": 200}, 200))
        got = [await anext(stream), await anext(stream)]
        built[0].hang = True
        await asyncio.sleep(0.05)  # the report loop waits for an answer that will never come
        built[0].die()
        got += [c async for c in stream]
        refused = await _collect(r, GenerateSpec("b", [1], {"max_tokens": 2}, 2))
        await asyncio.sleep(0.2)  # many report polls meet the dead engine
        await r.shutdown()
        return got, refused, ctl.reports, r

    with caplog.at_level(logging.INFO, logger="vtoken.replica"):
        got, refused, reports, replica = asyncio.run(go())
    assert got[-1].code == "unavailable" and "died" in got[-1].error and all(not c.error for c in got[:-1])
    assert [c.code for c in refused] == ["unavailable"] and "engine died" in refused[0].error
    down = [x for x in reports if not x.healthy]
    assert reports[0].healthy and down and reports[-1] in down
    assert all("engine died" in x.error and x.pool.total_blocks == 0 for x in down)
    assert caplog.text.count("its engine died") == 1 and replica.deaths == 1 and len(built) == 1
    assert "report failed" not in caplog.text


def _report(name, incarnation="i1", healthy=True, free=30, admitted=(), error=""):
    pool = empty_pool(32)._replace(free_blocks=free, total_blocks=64, admitted=tuple(admitted))
    return ReplicaReport(name, incarnation, healthy, False, 0, time.time(), pool, error)


def test_the_controller_restarts_a_replica_whose_engine_died_and_places_elsewhere_meanwhile(monkeypatch):
    ctl = Controller(parse_config({"model": "fake", "engine": {"kind": "fake"}}).model_dump())
    ctl.replicas["a"] = ReplicaState("a", handle="a")
    ctl.replicas["b"] = ReplicaState("b", handle="b")
    restarted: list[str] = []
    monkeypatch.setattr(ctl.lifecycle, "_restart_process", lambda st: restarted.append(st.name))

    async def go():
        await ctl.report("a", _report("a", free=60))
        await ctl.report("b", _report("b", free=10))
        assert (await ctl.place("q", 4))[0] == "a"
        await ctl.report("a", _report("a", healthy=False, free=0, error="engine died: x"))
        assert ctl.replicas["a"].state == "dead" and "q" not in ctl.promises and restarted == ["a"]
        await ctl.report("a", _report("a", healthy=False, free=0, error="engine died: x"))  # a late report
        assert restarted == ["a"]
        await ctl.report("a", _report("a", incarnation="i2", free=64))
        ctl.replicas["a"].state = ReplicaStatus.DEAD  # no report for dead_after_s while its engine went down
        await ctl.report("a", _report("a", incarnation="i2", healthy=False, error="engine died: y"))
        assert restarted == ["a", "a"] and ctl.replicas["a"].state == "dead"
        assert (await ctl.place("p", 4))[0] == "b"
        await ctl.report("a", _report("a", incarnation="i3", free=64))
        assert ctl.replicas["a"].state == "healthy" and ctl.lifecycle.recoveries

    asyncio.run(go())


def test_a_silent_replica_that_answers_a_ping_is_busy_not_dead():
    """Reports wait for the engine's step; a long prefill on a busy CPU made a healthy replica look dead (6 s
    without a report). The controller now asks the actor first: dead only if it does not answer."""

    class Handle:
        def __init__(self, answers: bool):
            self.answers = answers
            self.ping = self

        def remote(self):
            async def answer():
                if not self.answers:
                    await asyncio.sleep(60)
                return {"ready": True}

            return answer()

    cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "placement": {"dead_after_s": 0.3}})
    ctl = Controller(cfg.model_dump())
    ctl.replicas["busy"] = ReplicaState("busy", handle=Handle(True), state="healthy", reported_at=time.monotonic())
    ctl.replicas["gone"] = ReplicaState("gone", handle=Handle(False), state="healthy", reported_at=time.monotonic())
    marked: list[str] = []

    async def mark_failed(name, why=""):
        marked.append(name)
        ctl.replicas[name].state = ReplicaStatus.DEAD

    ctl.lifecycle.mark_failed = mark_failed

    async def go():
        monitor = asyncio.ensure_future(ctl._monitor())
        await asyncio.sleep(1.5)
        monitor.cancel()

    asyncio.run(go())
    assert ctl.replicas["busy"].state == "healthy" and ctl.replicas["busy"].alive_at > 0
    assert marked == ["gone"]


class Counted(FakeEngine):
    """Counts the pool reports asked of it (each one a utility call into a real engine's EngineCore)."""

    reads = 0

    async def pool_report(self):
        self.reads += 1
        return await super().pool_report()


def test_an_idle_replica_reads_its_engine_once_a_report_interval_and_a_busy_one_every_poll():
    """Polls every 10 ms, reports at least every 0.2 s. Idle for 0.5 s: a handful of engine reads, not ~50.
    Serving: a read every poll, and the report after the request ended shows its blocks free again (the pool
    is read once more after the last request leaves, before the reads slow down)."""
    engine = Counted(total_blocks=8, token_delay_s=0.01)

    async def go():
        ctl = StubController()
        r = Replica("r1", lambda: engine, ctl, report_interval_s=0.2, poll_s=0.01)
        await r.start()
        await asyncio.sleep(0.5)
        idle = engine.reads
        busy_from = engine.reads
        got = await _collect(r, GenerateSpec("a", [1] * 40, {"max_tokens": 30}, 30))
        busy = engine.reads - busy_from
        await asyncio.sleep(0.1)
        after = engine.reads
        await asyncio.sleep(0.4)
        await r.shutdown()
        return idle, busy, engine.reads - after, got, ctl.reports

    idle, busy, idle_again, got, reports = asyncio.run(go())
    assert got[-1].finished and not got[-1].error
    assert idle <= 5 and idle_again <= 4, (idle, idle_again)  # one read each 0.2 s, not one each 10 ms
    assert busy >= 5, busy  # 30 tokens of 10 ms: a read every poll (about 30)
    busy_reports = [x for x in reports if x.pool.running]
    assert busy_reports and reports[-1].pool.running == 0 and reports[-1].pool.free_blocks == 8


def test_a_request_the_engine_ended_with_an_error_is_internal_for_its_client_alone():
    """vLLM's finish reason "error" (vToken could not decide for that request, tests/test_engine_failure.py): the
    replica sends an internal error for that request only; the engine is not dead and serves on."""
    from types import SimpleNamespace

    from actors.engines import ENDED_WITH_ERROR, VLLMEngine

    class StubLLM:
        errored = False

        async def generate(self, prompt, params, rid, **engine_kwargs):
            done = rid == "bad"
            reason = "error" if done else "length"
            out = SimpleNamespace(index=0, text="", token_ids=[] if done else [5], cumulative_logprob=None,
                                  finish_reason=reason, stop_reason=None, logprobs=None)  # fmt: skip
            yield SimpleNamespace(outputs=[out], finished=True, prompt_logprobs=None, num_cached_tokens=0)

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.live = StubLLM(), {}

    async def chunks(rid):
        return [c async for c in engine.generate(GenerateSpec(rid, [1, 2], {"max_tokens": 1}, 1))]

    bad, good = asyncio.run(chunks("bad")), asyncio.run(chunks("good"))
    assert bad == [Chunk.failed("internal", ENDED_WITH_ERROR)] and not engine.errored
    assert good[0].seqs[0].token_ids == (5,) and good[0].finish_reason == "length"
    assert failure(bad[0], "r")[0] == "internal"
