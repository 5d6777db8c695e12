"""The replica lifecycle: create, start, probe, restart, drain, and the one place a replica's status changes.

``ReplicaLifecycle`` owns the Ray actors; the controller (cluster/control/controller.py) holds one and keeps
placement, promises, reports and scaling itself. Every status change goes through ``transition``, which checks it
against ``replica_status.TRANSITIONS``, tells the controller whenever the replica does not serve afterwards
(``on_stop``: it voids the replica's promises, since a promise counts blocks against a replica only placement can
pick, and forgets its prefix cache), keeps the death and recovery times, and logs the change with its reason.

Replicas are **detached** Ray actors, named ``<name>-replica-<n>`` in the service's namespace. An actor that is
not detached shares its owner's fate: when the controller that created them died (its node lost), Ray killed
every replica with it, healthy ones on healthy nodes included, and nothing served until a person restarted
everything. Detached, a replica outlives its controller and keeps serving; the controller (restarted by Ray,
cluster/server.py) finds the live replicas by name and rebuilds its view from their reports (``recover``).
The other way, replicas owned by the `vtoken serve` process, would need that process to create every replica
the controller asks for (scale-out, replacements) over a channel of its own; naming them is what Ray Serve does
for its replicas too. What detached actors cost, nothing cleaning them up by itself, is paid here: the
controller kills every replica it drains (scale-in, shutdown), `vtoken serve` kills whatever is left under the
service's names when it stops and before it starts (cluster/server.py), and a replica whose controller is gone
for good stops itself (actors/replica.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.engines import EngineFactory
from actors.replica import Replica
from actors.report import ReplicaReport, unreported
from cluster.config import ServeConfig, engine_args
from cluster.control.replica_status import ReplicaStatus, check_transition

log = logging.getLogger("vtoken.controller")
QUIET_KEYS = ("VLLM_LOGGING_LEVEL", "PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_VERBOSITY", "TQDM_DISABLE")


def replica_prefix(name: str) -> str:
    """The names of a service's replicas start so (``<name>-replica-<n>``, n never reused by one controller)."""
    return f"{name}-replica-"


def replica_names(name: str) -> list[str]:
    """The live (or restarting) replicas of service ``name`` in this process's Ray namespace, by name."""
    prefix = replica_prefix(name)
    return sorted(n for n in ray.util.list_named_actors() if isinstance(n, str) and n.startswith(prefix))


def replica_env() -> dict[str, str]:
    """The environment replicas start with: this process's log settings (`vtoken serve` quiet or --verbose;
    Ray passes them on from the driver to the controller), vLLM at WARNING unless set."""
    env = {k: os.environ[k] for k in QUIET_KEYS if k in os.environ}
    return {"VLLM_LOGGING_LEVEL": "WARNING", **env, "TOKENIZERS_PARALLELISM": "false"}


def engine_factory(cfg: ServeConfig) -> EngineFactory:
    e = cfg.engine
    if e.kind == "fake":
        return EngineFactory(
            "fake",
            {
                "total_blocks": e.fake_total_blocks,
                "block_size": e.block_size,
                "token_delay_s": e.fake_token_delay_s,
                "start_s": e.fake_start_s,
                "reclaim_fraction": e.fake_reclaim_fraction,
            },
        )
    # The same arguments build the gateway's config (cluster/serving/frontend.py): it validates what replicas run.
    return EngineFactory("vllm", {"model": cfg.model, "vtoken": cfg.vtoken, "engine_args": engine_args(cfg)})


def start_error(e: BaseException) -> str:
    """One line for an engine that failed to start: the replica's own reason (EngineStartFailed: vLLM's root
    cause), never Ray's traceback around it (a RayTaskError's text is the whole remote traceback)."""
    cause = getattr(e, "cause", None) or e  # ray.exceptions.RayTaskError carries the remote exception
    text = str(cause).strip().splitlines()
    line = text[-1] if text and text[0].startswith("Traceback") else (text[0] if text else type(cause).__name__)
    return line if len(line) <= 1000 else line[:997] + "..."


@dataclass
class ReplicaState:
    """One replica as the controller knows it. ``state`` changes only in ``ReplicaLifecycle.transition``."""

    name: str
    handle: Any
    state: ReplicaStatus = ReplicaStatus.STARTING
    report: ReplicaReport = field(default_factory=unreported)
    reported_at: float = 0.0
    died_at: float | None = None  # when it (or the replica it replaces) stopped serving; None while serving
    task: asyncio.Task | None = None
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND of this replica (pin_cpus)
    error: str = ""  # why it failed to start
    phase: str = "waiting for Ray to place it"  # what it is doing before it serves (vtoken serve shows it)
    restarted: str = ""  # the incarnation whose process was restarted because its engine died
    alive_at: float = 0.0  # it last answered a ping (reports wait for the engine's step; pings do not)
    probe: asyncio.Task | None = None

    def __post_init__(self):
        self.state = ReplicaStatus(self.state)  # "healthy" -> ReplicaStatus.HEALTHY; an unknown one raises


class ReplicaLifecycle:
    """The replicas' actors and statuses, held by the controller. ``replicas`` is the controller's own dict (name ->
    ReplicaState), which only this class adds to and removes from (``remove``); ``on_stop(name)`` is called whenever
    a replica stops serving or is removed, for what the controller keeps about it (its promises, its prefix cache).
    ``seq`` numbers the replicas created (never reused by one controller); ``recoveries``: the last seconds from a
    death to serving again. ``cfg`` is read for the service's name, ``replica`` and ``placement.dead_after_s``."""

    def __init__(
        self,
        cfg: ServeConfig,
        factory: EngineFactory,
        replicas: dict[str, ReplicaState],
        on_stop: Callable[[str], None],
    ):
        self.cfg, self.factory, self.replicas, self.on_stop = cfg, factory, replicas, on_stop
        self.seq = 0
        self.recoveries: collections.deque[float] = collections.deque(maxlen=100)

    # ------------------------------------------------------------------ status
    def transition(self, st: ReplicaState, to: ReplicaStatus, why: str) -> None:
        """The only place a replica's status changes: checked against the table, promises voided on every
        path that ends outside serving, death and recovery times kept, logged."""
        frm = ReplicaStatus(st.state)
        check_transition(st.name, frm, to, why)
        st.state = to
        if not to.serving():
            self.on_stop(st.name)
        now = time.monotonic()
        if to is ReplicaStatus.DEAD:
            st.died_at = st.died_at or now
        extra = ""
        if to is ReplicaStatus.HEALTHY and st.died_at is not None:
            self.recoveries.append(now - st.died_at)
            st.died_at, extra = None, f", serving again {self.recoveries[-1]:.1f}s after its death"
        level = {ReplicaStatus.FAILED: logging.ERROR, ReplicaStatus.DEAD: logging.WARNING}.get(to, logging.INFO)
        log.log(level, "replica %s: %s -> %s: %s%s", st.name, frm, to, why, extra)

    def count(self, *states: ReplicaStatus) -> int:
        return sum(st.state in states for st in self.replicas.values())

    def remove(self, st: ReplicaState, why: str) -> None:
        self.replicas.pop(st.name, None)
        self.on_stop(st.name)
        log.info("replica %s removed: %s", st.name, why)

    # ------------------------------------------------------------------ create, start, restart, drain
    def create(self, died_at: float | None = None) -> None:
        self.seq += 1
        name = f"{replica_prefix(self.cfg.name)}{self.seq}"
        r = self.cfg.replica
        cores = self._free_cores() if r.pin_cpus else None
        env = {**replica_env(), **({"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {})}
        handle = (
            ray.remote(Replica)
            .options(
                name=name,
                lifetime="detached",  # outlives the controller: see the module's docstring
                scheduling_strategy=r.scheduling.upper(),  # SPREAD: one node lost takes as few replicas as can be
                num_cpus=r.num_cpus,
                num_gpus=r.num_gpus,
                max_restarts=r.max_restarts,
                max_task_retries=0,
                max_concurrency=10000,
                runtime_env={"env_vars": env},
            )
            .remote(
                name,
                self.factory,
                ray.get_runtime_context().current_actor,
                r.report_interval_s,
                r.change_fraction,
                orphan_after_s=r.orphan_after_s,
            )
        )
        st = ReplicaState(name, handle, died_at=died_at, cores=cores)
        self.replicas[name] = st
        st.task = asyncio.ensure_future(self._start_replica(st))
        log.info("replica %s created", name)

    def adopt(self, name: str, why: str) -> bool:
        """Take over the live replica ``name`` that another incarnation of this controller created (a restart);
        False when it is gone. It starts as ``starting`` and serves again at its first healthy report (``start``
        is idempotent: for a replica already serving it returns at once and its reports carry on)."""
        if name in self.replicas:
            return True
        try:
            handle = ray.get_actor(name)
        except ValueError:  # killed meanwhile: nothing to take over
            return False
        st = ReplicaState(name, handle)
        self.replicas[name] = st
        with contextlib.suppress(ValueError):
            self.seq = max(self.seq, int(name.rsplit("-", 1)[1]))
        st.task = asyncio.ensure_future(self._start_replica(st))
        log.info("replica %s taken over: %s", name, why)
        return True

    def recover(self) -> int:
        """After a restart: every live replica of this service, found by name, taken over. Returns how many."""
        return sum(self.adopt(n, "alive after a controller restart") for n in replica_names(self.cfg.name))

    def _free_cores(self) -> str | None:
        """The lowest cores no live replica is bound to, ``max(1, num_cpus)`` of them ("2-3"); None when
        the node has none left (the replica then shares cores, as without pin_cpus)."""
        n = max(1, int(self.cfg.replica.num_cpus))
        used = set()
        for st in self.replicas.values():
            if st.cores and st.state is not ReplicaStatus.DEAD:
                a, _, b = st.cores.partition("-")
                used.update(range(int(a), int(b or a) + 1))
        total = os.cpu_count() or 1
        for start in range(0, total - n + 1):
            if not used & set(range(start, start + n)):
                return str(start) if n == 1 else f"{start}-{start + n - 1}"
        return None

    async def _start_replica(self, st: ReplicaState, dead: str | None = None) -> None:
        """(Re)start the engine. Ray restarts a killed process by itself; a replica Ray gave up on
        (restarts exhausted, node gone) is replaced by a new actor. ``dead``: the incarnation being killed,
        which may still answer for a moment; only a new process counts as started."""
        while True:
            try:
                ip, _, pid = await st.handle.where.remote()  # answers once Ray has placed the actor
                st.phase = f"loading its engine on node {ip} (pid {pid})"
                if await st.handle.start.remote() != dead:
                    return
                await asyncio.sleep(0.5)
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.5)  # restarting: try again
            except ray.exceptions.RayActorError as e:
                log.warning("replica %s is gone for good (%s); replacing it", st.name, e)
                ray.kill(st.handle, no_restart=True)
                self.remove(st, "replaced")
                self.create(died_at=st.died_at or time.monotonic())
                return
            except Exception as e:  # the engine itself failed to start (bad model, too small a pool)
                st.error = start_error(e)
                if st.state is not ReplicaStatus.DRAINING:  # a replica being drained is on its way out anyway
                    self.transition(st, ReplicaStatus.FAILED, f"its engine failed to start: {st.error}")
                return

    def _restart_process(self, st: ReplicaState) -> None:
        """A fresh process and engine for a replica whose engine died: Ray restarts the killed actor
        (``max_restarts``; if exhausted, ``_start_replica`` replaces it) and ``_start_replica`` starts it,
        waiting past the dying incarnation."""
        ray.kill(st.handle, no_restart=False)
        if st.task is not None and not st.task.done():
            st.task.cancel()  # a start that may take the dying process for a started one
        st.task = asyncio.ensure_future(self._start_replica(st, dead=st.report.incarnation))

    async def drain(self, st: ReplicaState, timeout_s: float = 60, why: str = "scale-in") -> ReplicaReport | None:
        if st.state is not ReplicaStatus.DRAINING:  # shutdown drains a replica that scale-in is draining already
            self.transition(st, ReplicaStatus.DRAINING, why)
        final = None
        try:
            final = await asyncio.wait_for(st.handle.drain.remote(timeout_s), timeout_s + 10)
            await asyncio.wait_for(st.handle.shutdown.remote(), 30)
        except Exception as e:  # a dead replica has nothing to drain
            log.warning("replica %s: drain failed: %s", st.name, e)
        ray.kill(st.handle, no_restart=True)
        self.remove(st, "drained")
        return final

    # ------------------------------------------------------------------ health
    def on_health(self, st: ReplicaState, r: ReplicaReport) -> None:
        """A report's part in the replica's status (the caller has checked ``st.state.takes_reports()``)."""
        if st.state in (ReplicaStatus.STARTING, ReplicaStatus.DEAD) and r.healthy:
            self.transition(st, ReplicaStatus.HEALTHY, "reported healthy")
        elif (
            not r.healthy and st.state in (ReplicaStatus.HEALTHY, ReplicaStatus.DEAD) and st.restarted != r.incarnation
        ):
            # The process is alive but its engine died (it may have been marked dead already for reports
            # that stopped while its engine went down): restart the process, once per incarnation.
            self.transition(st, ReplicaStatus.DEAD, f"not serving ({r.error or 'no engine'}); restarting its process")
            st.restarted = r.incarnation
            self._restart_process(st)

    async def mark_failed(self, name: str, why: str = "call failed") -> None:
        st = self.replicas.get(name)
        if st is not None and st.state in (ReplicaStatus.HEALTHY, ReplicaStatus.STARTING):
            self.transition(st, ReplicaStatus.DEAD, why)
            if st.task is None or st.task.done():
                st.task = asyncio.ensure_future(self._start_replica(st))

    def probe_silent(self, now: float) -> None:
        """Probe every serving replica with no report nor ping answer for ``dead_after_s``."""
        for st in list(self.replicas.values()):
            quiet = now - max(st.reported_at, st.alive_at)
            if st.state is ReplicaStatus.HEALTHY and quiet > self.cfg.placement.dead_after_s:
                if st.probe is None or st.probe.done():
                    st.probe = asyncio.ensure_future(self._probe(st, now - st.reported_at))

    async def _probe(self, st: ReplicaState, silent_s: float) -> None:
        """A replica silent for dead_after_s: a report waits for its engine's step (long prefills on a busy CPU
        take seconds), so ask the actor itself before calling it dead. Engine death is reported, not silent."""
        try:
            info = await asyncio.wait_for(st.handle.ping.remote(), timeout=min(5.0, self.cfg.placement.dead_after_s))
        except Exception as e:  # no answer, or the actor is gone
            await self.mark_failed(st.name, f"no report for {silent_s:.1f}s and no answer ({type(e).__name__})")
            return
        if not info["ready"]:
            # It answers, but from a process without an engine: Ray restarted it (its process died, or its node
            # was lost and Ray placed it again elsewhere) and nobody has started it yet. Nothing would: no
            # request fails there (it refuses them, so they go elsewhere) and it sends no reports until started.
            await self.mark_failed(st.name, f"no report for {silent_s:.1f}s; Ray restarted its process, not started")
            return
        st.alive_at = time.monotonic()
        log.info("replica %s: no report for %.1fs, but it answers: busy, not dead", st.name, silent_s)
