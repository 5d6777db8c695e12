"""Replica: a Ray actor that hosts one engine, streams tokens, aborts on cancel, and reports its pool.

Lifecycle: the constructor only stores its arguments, so a Ray restart (``max_restarts``) is cheap and the
controller decides when to build the engine: ``start()`` builds it (idempotent; in a thread, so pings keep
answering during the ~30 s vLLM start) and begins reporting. Reports go to the controller at least every
``report_interval_s`` and at once when the pool changes by ``change_fraction`` of its blocks or the
running/waiting counts, the admitted requests or the health change. ``incarnation`` changes with every
engine, so the controller can tell a new one from a late report of the old one. A report's ``pool.admitted``
lists the requests whose blocks its figures count: the controller keeps a request's promise until then, so
its blocks are never counted twice (promise and ``free_blocks``) nor not at all (promise dropped, figures
older than the admission).

A replica is a detached actor (cluster/control/lifecycle.py says why): it outlives a controller that dies, reports to
the restarted one through the same handle (Ray restarts the controller under the same actor id), and is killed
by its controller on scale-in and shutdown. A replica whose controller is gone for good (its `vtoken serve` ended
without a shutdown: killed, its machine lost) has nobody left to stop it: after ``orphan_after_s`` of such
answers (``replica.orphan_after_s`` in the config) it shuts its engine down and has Ray kill it for good, so
nothing is left running on the cluster.

An engine that dies under a live replica (vLLM's EngineCore process killed, out of memory) is noticed by the
next request or report: the replica logs it once, answers requests ``unavailable`` (the gateway places those
that streamed nothing elsewhere) and reports itself unhealthy with the reason. The controller then stops
placing there and restarts the replica's process, as for a replica that died itself: a fresh process starts a
fresh engine (building a second AsyncLLM in the process of a dead one was seen to hang in vLLM's start-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.engines import Chunk, Engine, EngineDead, EngineFactory, GenerateSpec, one_line
from actors.report import ReplicaReport, empty_pool
from actors.stderr_tap import StderrTap
from actors.token_channel import ChannelAddress, TokenSender, is_loopback
from vtoken.pool_report import PoolReport

log = logging.getLogger("vtoken.replica")
REPORT_TIMEOUT_S = 60.0  # an engine step can hold a report back; a pool report that takes longer is a fault
ORPHAN_AFTER_S = 30.0  # the controller dead for good this long (not restarting): the replica stops itself


class EngineStartFailed(RuntimeError):
    """The replica's engine could not start; the message is the cause, in one line."""


def _in_actor() -> bool:
    import ray

    return ray.is_initialized() and bool(ray.get_runtime_context().get_actor_id())


def _incarnation() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Replica:
    """Invariants: a request is in ``inflight`` exactly while its generator runs; after ``drain()`` returns,
    no request is in flight and new ones are refused; a cancelled or aborted request is aborted in the engine;
    ``engine`` is None exactly while no working engine exists (starting, or after its death)."""

    def __init__(
        self,
        name: str,
        factory: EngineFactory,
        controller: Any = None,
        report_interval_s: float = 1.0,
        change_fraction: float = 0.05,
        poll_s: float = 0.2,
        orphan_after_s: float = ORPHAN_AFTER_S,
    ):
        self.name, self.factory, self.controller = name, factory, controller
        self.report_interval_s, self.change_fraction, self.poll_s = report_interval_s, change_fraction, poll_s
        self.orphan_after_s = orphan_after_s
        self.incarnation = _incarnation()
        self.engine: Engine | None = None
        self.error = ""  # why there is no engine now
        self.deaths = 0  # engines that died under this replica
        self.inflight: set[str] = set()
        self.draining = False
        self._starting: asyncio.Future | None = None
        self._reporter: asyncio.Task | None = None
        self._last: ReplicaReport | None = None  # the last report sent
        self._read: tuple[Engine | None, PoolReport | None, float] = (None, None, 0.0)  # engine, pool, when read
        self._report_failing = False
        self._snapshot_asked = False  # the controller asked for the whole prefix cache, not a delta
        self._sender = TokenSender()
        self._node = ""
        self._where: tuple[str, str, int] | None = None  # (node ip, node id, pid), once known
        self._orphaned_at: float | None = None  # when the controller was first found dead for good
        if controller is not None and _in_actor():  # watch for a start that never comes
            threading.Thread(target=self._watch_unstarted, name="replica-orphan-watch", daemon=True).start()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Build the engine if not built yet and start reporting; returns the incarnation."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._build())
        await asyncio.shield(self._starting)
        if self._reporter is None and self.controller is not None:
            self._reporter = asyncio.ensure_future(self._report_loop())
        return self.incarnation

    async def _build(self) -> None:
        """Build the engine in a thread. When it fails, the error says why in vLLM's own words (the root cause
        its EngineCore process printed, actors/stderr_tap.py), in one line, not vLLM's "see root cause above"."""
        tap = StderrTap.install() if _in_actor() else None
        mark = tap.mark() if tap else 0
        try:
            self.engine = await asyncio.to_thread(self.factory)
        except Exception as e:
            cause = await asyncio.to_thread(tap.error_since, mark) if tap else ""
            raise EngineStartFailed(cause or one_line(f"{type(e).__name__}: {e}")) from None

    async def ping(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "ready": self.engine is not None,
            "draining": self.draining,
            "inflight": len(self.inflight),
            "engine_deaths": self.deaths,
        }

    async def drain(self, timeout_s: float = 60.0) -> ReplicaReport:
        """Refuse new requests, wait for the in-flight ones (abort what is left at the timeout), report."""
        self.draining = True
        t_end = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        for rid in list(self.inflight):
            await self.abort(rid)
        return await self.report()

    async def shutdown(self) -> None:
        self._sender.close()
        if self._reporter is not None:
            self._reporter.cancel()
        if self.engine is not None:
            await self.engine.shutdown()

    # ------------------------------------------------------------------ engine death
    def _engine_died(self, engine: Engine, why: str) -> None:
        """The first caller that meets the dead engine (a request, the report loop) records the death; later
        callers find ``engine`` already cleared, so it is logged once, not once per poll."""
        if self.engine is not engine:
            return
        self.deaths += 1
        self.engine, self.error = None, f"engine died: {why}"
        log.error("replica %s: its engine died (%s); reporting unhealthy for a restart", self.name, why)

    # ------------------------------------------------------------------ serving
    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        """Streams the engine's chunks (a Ray streaming generator). Cancellation (``ray.cancel`` or the
        caller dropping the stream) and ``abort`` both abort the request in the engine. Nothing raises out of
        here: failures are chunks with a code (engines.ERROR_CODES) and one line for the client."""
        engine = self.engine
        if engine is None or self.draining:
            why = "draining" if self.draining else ("down: " + self.error if self.error else "starting")
            yield Chunk.failed("unavailable", f"replica {self.name} is {why}")
            return
        rid = spec.request_id
        self.inflight.add(rid)
        finished = False
        try:
            async for chunk in engine.generate(spec):
                finished = chunk.finished or bool(chunk.error)
                yield chunk
        except EngineDead as e:
            finished = True
            self._engine_died(engine, str(e))
            yield Chunk.failed("unavailable", f"the engine of replica {self.name} died")
        except Exception:
            # The traceback stays in this log; the client hears only that it failed, and the request id.
            log.exception("replica %s: request %s failed", self.name, rid)
            yield Chunk.failed("internal", f"replica {self.name} failed to serve the request")
        finally:
            self.inflight.discard(rid)
            if not finished:
                with contextlib.suppress(Exception):  # nothing to abort in an engine that is gone
                    await asyncio.shield(engine.abort(rid))

    async def generate_to(self, spec: GenerateSpec, address: ChannelAddress, gateway_node: str = "") -> int:
        """``generate``'s chunks sent to the gateway's token channel at ``address`` (actors/token_channel.py: its
        endpoint and the CURVE keys it admits) instead of streamed through Ray; returns how many were sent, or -1
        without serving when ``address`` is a loopback one on another node than this replica's. Cancelling the call
        aborts the request, as does a gateway that takes no chunk for token_channel.SEND_TIMEOUT_S."""
        if gateway_node and is_loopback(address.endpoint) and gateway_node != self._node_ip():
            return -1
        sent, rid = 0, spec.request_id
        async with contextlib.aclosing(self.generate(spec)) as chunks:
            async for chunk in chunks:
                try:
                    await self._sender.send(address, rid, chunk)
                except TimeoutError:
                    log.warning("replica %s: the gateway at %s took no chunk; aborting %s", self.name, address, rid)
                    break  # closing the generator aborts the request in the engine
                sent += 1
        return sent

    def _node_ip(self) -> str:
        if not self._node:
            import ray

            self._node = ray.util.get_node_ip_address()
        return self._node

    def where(self) -> tuple[str, str, int]:
        """(node ip, node id, pid): where this replica runs, for its reports (outside Ray: no node)."""
        if self._where is None:
            import ray

            node = (self._node_ip(), ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ("", "")
            self._where = (*node, os.getpid())
        return self._where

    async def abort(self, request_id: str) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        """The engine's own statistics (``Engine.stats``): what each request it served asked for and did."""
        return await self.engine.stats() if self.engine is not None else {}

    # ------------------------------------------------------------------ reporting
    async def report(self) -> ReplicaReport:
        """The engine's pool report plus health; a dead engine is noticed here too."""
        engine, pool = self.engine, empty_pool()
        if engine is not None:
            try:
                idle = self._idle_pool(engine)
                if idle is None:
                    pool = await self._pool_report(engine)
                    self._read = (engine, pool, time.monotonic())
                else:
                    pool = idle
            except EngineDead as e:
                self._engine_died(engine, str(e))
                engine = None
        queries, hits = engine.prefix_counters() if engine is not None else (0, 0)
        return ReplicaReport(
            self.name,
            self.incarnation,
            engine is not None,
            self.draining,
            len(self.inflight),
            time.time(),
            pool,
            self.error,
            *self.where(),
            prefix_queries=queries,
            prefix_hits=hits,
        )

    def _idle_pool(self, engine: Engine) -> PoolReport | None:
        """The last pool read again while nothing can have changed it: no request in flight here, none running or
        waiting at that read, the same engine, alive, and the read younger than ``report_interval_s``. An idle
        replica then asks its engine once per ``report_interval_s``, not every ``poll_s``: vLLM's EngineCore
        answers a utility call between steps, so the polls of a replica that serves nothing would otherwise wake
        it (and whatever it shares cores with) five times a second. None: read the engine."""
        last, read_at = self._read[1], self._read[2]
        if self._read[0] is not engine or engine.errored or self.inflight or last is None:
            return None
        if last.running or last.waiting or last.admitted or time.monotonic() - read_at >= self.report_interval_s:
            return None
        return last

    async def _pool_report(self, engine: Engine) -> PoolReport:
        """``engine.pool_report()``, watching the engine meanwhile: a utility call that was under way when
        vLLM's EngineCore died is never answered, and waiting for it would stop the reports for good."""
        if engine.errored:
            raise EngineDead("the engine stopped")
        call = asyncio.ensure_future(engine.pool_report())
        t_end = time.monotonic() + REPORT_TIMEOUT_S
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=self.poll_s)
                if done:
                    return call.result()
                if engine.errored:
                    raise EngineDead("the engine stopped while reporting")
                if time.monotonic() > t_end:
                    raise TimeoutError(f"the engine did not report within {REPORT_TIMEOUT_S:.0f}s")
        finally:
            call.cancel()

    def _changed(self, r: ReplicaReport) -> bool:
        last = self._last
        if last is None or (r.healthy, r.incarnation, r.pool.admitted) != (
            last.healthy,
            last.incarnation,
            last.pool.admitted,
        ):
            return True
        p, q = r.pool, last.pool
        step = max(1, int(self.change_fraction * max(p.total_blocks, 1)))
        return abs(p.free_blocks - q.free_blocks) >= step or (p.running, p.waiting) != (q.running, q.waiting)

    async def _report_loop(self) -> None:
        sent_at = 0.0
        while True:
            try:
                r = await self.report()
                tracker = self.engine.prefix if self.engine is not None else None
                changed = tracker is not None and (tracker.pending() or self._snapshot_asked)
                if changed or self._changed(r) or time.monotonic() - sent_at >= self.report_interval_s:
                    await self._send(r, tracker)
                    self._last, sent_at = r, time.monotonic()
                if self._report_failing:
                    log.info("replica %s: reports reach the controller again", self.name)
                    self._report_failing = False
                self._orphaned_at = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a slow or restarting controller must not stop the reports
                if not self._report_failing:  # once per outage, not once per poll
                    log.warning("replica %s: report failed: %s (retrying every %.1fs)", self.name, e, self.poll_s)
                    self._report_failing = True
                if await self._orphaned(e):
                    return
            await asyncio.sleep(self.poll_s)

    async def _send(self, r: ReplicaReport, tracker) -> None:
        """One report to the controller, with the prefix cache's change since the last one sent (a snapshot when the
        controller asked for one: it answers True when a delta did not follow the one before)."""
        if tracker is not None:
            r = r._replace(prefix=tracker.cut(full=self._snapshot_asked))
            self._snapshot_asked = True  # until the controller has it: a report lost on the way leaves a gap
        answer = await asyncio.wait_for(self.controller.report.remote(self.name, r), timeout=5)
        self._snapshot_asked = answer is True

    def _watch_unstarted(self, every_s: float = 10.0) -> None:
        """Until ``start()`` is called: a controller that died for good before it could call it (its `vtoken serve`
        killed while this replica's process was still starting) leaves this actor idle forever, holding its CPUs.
        A thread, because nothing else runs in an actor nobody calls. Once started, the report loop watches."""
        import ray

        while self._starting is None:
            time.sleep(every_s)
            try:
                ray.get(self.controller.__ray_ready__.remote(), timeout=every_s)
                self._orphaned_at = None
            except ray.exceptions.ActorDiedError:
                now = time.monotonic()
                self._orphaned_at = self._orphaned_at or now
                if self._starting is None and now - self._orphaned_at >= self.orphan_after_s:
                    log.warning("replica %s: its controller is gone for good and never started it; stopping", self.name)
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    return
            except Exception:  # slow, or being restarted: it may still start this replica
                self._orphaned_at = None

    async def _orphaned(self, e: Exception) -> bool:
        """True (after stopping this replica for good) once the controller has been dead for good for
        ``orphan_after_s``. Ray says ActorDiedError only when it will not restart the actor (its owner, `vtoken
        serve`, is gone); a controller being restarted answers ActorUnavailableError, and the replica waits."""
        import ray

        if not isinstance(e, ray.exceptions.ActorDiedError):
            self._orphaned_at = None
            return False
        now = time.monotonic()
        self._orphaned_at = self._orphaned_at or now
        if now - self._orphaned_at < self.orphan_after_s:
            return False
        log.warning("replica %s: its controller is gone for good (its vtoken serve ended); stopping", self.name)
        self._reporter = None  # this is the report loop: shutdown() must not cancel it half-way
        with contextlib.suppress(Exception):
            await self.drain(5.0)
            await self.shutdown()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        return True
