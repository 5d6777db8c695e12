"""Controller: a Ray actor that owns the replicas, aggregates their reports and places every request.

Replica states: starting -> healthy -> (dead -> starting -> healthy)* -> draining -> gone.
  * healthy: has reported since its last (re)start; the only state placement ever sees.
  * dead: a call failed (the gateway says so) or no report for ``dead_after_s``. Ray restarts the process
    (``max_restarts``) and the controller calls ``start()`` again; if Ray gave up, a new actor replaces it.
  * draining: scale-in; takes no new requests, is killed once its in-flight requests are done.
Promises: a request placed on a replica counts its estimated blocks against it until a report of that replica
lists it as admitted (that report's ``free_blocks`` counts its blocks) or until the request ends, whichever
is first. Dropping it at the first token instead would count its blocks twice while they are allocated but
unreported (prefill), or not at all when the report is older than the admission.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray

from actors.engines import EngineFactory
from actors.replica import Replica
from actors.report import ReplicaReport, unreported
from cluster.autoscaler import Autoscaler, request_cluster_resources
from cluster.config import ServeConfig
from cluster.placement import ReplicaView, make_strategy

log = logging.getLogger("vtoken.controller")
QUIET_KEYS = ("VLLM_LOGGING_LEVEL", "PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_VERBOSITY", "TQDM_DISABLE")


def replica_env() -> dict[str, str]:
    """The environment replicas start with: this process's log settings (`vtoken serve` quiet or --verbose;
    Ray passes them on from the driver to the controller), vLLM at WARNING unless set."""
    env = {k: os.environ[k] for k in QUIET_KEYS if k in os.environ}
    return {"VLLM_LOGGING_LEVEL": "WARNING", **env, "TOKENIZERS_PARALLELISM": "false"}


class Promise(NamedTuple):
    """Blocks a placed request counts against its replica until a report counts them (or it ends)."""

    replica: str
    blocks: int
    at: float  # time.monotonic() of the placement


@dataclass
class ReplicaState:
    name: str
    handle: Any
    state: str = "starting"
    report: ReplicaReport = field(default_factory=unreported)
    reported_at: float = 0.0
    died_at: float | None = None
    task: asyncio.Task | None = None
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND of this replica (pin_cpus)
    error: str = ""  # why it failed to start
    restarted: str = ""  # the incarnation whose process was restarted because its engine died
    alive_at: float = 0.0  # it last answered a ping (reports wait for the engine's step; pings do not)
    probe: asyncio.Task | None = None


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
    args = {
        "dtype": e.dtype,
        "block_size": e.block_size,
        "max_model_len": e.max_model_len,
        "enforce_eager": e.enforce_eager,
        "seed": 0,
        **e.extra,
    }
    if e.kv_cache_memory_bytes:
        args["kv_cache_memory_bytes"] = e.kv_cache_memory_bytes
    return EngineFactory("vllm", {"model": cfg.model, "vtoken": cfg.vtoken, "engine_args": args})


class Controller:
    def __init__(self, cfg: dict[str, Any], local: bool = True):
        self.cfg = ServeConfig(**cfg)
        self.local, self.factory = local, engine_factory(self.cfg)
        self.strategy = make_strategy(self.cfg.placement.strategy)
        self.autoscaler = Autoscaler(self.cfg.autoscaling)
        self.replicas: dict[str, ReplicaState] = {}
        self.target, self.seq = self.cfg.replicas, 0
        # Every structure here is bounded however long the deployment runs: promises end with their request,
        # with a report that counts them, with their replica, or after promise_ttl_s (a request whose end the
        # controller never heard of: a gateway gone, a lost message); the rest keep the last few entries.
        self.promises: dict[str, Promise] = {}
        self.decisions: collections.deque = collections.deque(maxlen=50)
        # Cumulative counts for /metrics: placements by (strategy, replica), pruned to live replicas each
        # second; scaling decisions by (direction, trigger), four keys at most.
        self.placements: collections.Counter[tuple[str, str]] = collections.Counter()
        self.decision_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.recoveries: collections.deque[float] = collections.deque(maxlen=100)
        self._tasks: set[asyncio.Future] = set()  # fire-and-forget work (drains), held until done
        self._loop: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float = 600) -> int:
        """Create the replicas and wait until ``target`` of them are healthy; returns how many are."""
        self._reconcile()
        self._loop = asyncio.ensure_future(self._monitor())
        t_end = time.monotonic() + timeout_s
        while self._count("healthy") < self.target and time.monotonic() < t_end:
            if self._count("failed"):
                raise RuntimeError(next(st.error for st in self.replicas.values() if st.state == "failed"))
            await asyncio.sleep(0.2)
        return self._count("healthy")

    async def shutdown(self, timeout_s: float = 30) -> list[ReplicaReport]:
        """Drain every replica and kill it; returns each replica's final report (all blocks free)."""
        if self._loop:
            self._loop.cancel()
        finals = await asyncio.gather(*(self._drain(st, timeout_s) for st in list(self.replicas.values())))
        return [f for f in finals if f]

    def _count(self, *states: str) -> int:
        return sum(st.state in states for st in self.replicas.values())

    def _create(self, died_at: float | None = None) -> None:
        self.seq += 1
        name = f"{self.cfg.name}-replica-{self.seq}"
        r = self.cfg.replica
        cores = self._free_cores() if r.pin_cpus else None
        env = {**replica_env(), **({"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {})}
        handle = (
            ray.remote(Replica)
            .options(
                name=name,
                num_cpus=r.num_cpus,
                num_gpus=r.num_gpus,
                max_restarts=r.max_restarts,
                max_task_retries=0,
                max_concurrency=10000,
                runtime_env={"env_vars": env},
            )
            .remote(name, self.factory, ray.get_runtime_context().current_actor, r.report_interval_s, r.change_fraction)
        )
        st = ReplicaState(name, handle, died_at=died_at, cores=cores)
        self.replicas[name] = st
        st.task = asyncio.ensure_future(self._start_replica(st))
        log.info("replica %s created", name)

    def _free_cores(self) -> str | None:
        """The lowest cores no live replica is bound to, ``max(1, num_cpus)`` of them ("2-3"); None when
        the node has none left (the replica then shares cores, as without pin_cpus)."""
        n = max(1, int(self.cfg.replica.num_cpus))
        used = set()
        for st in self.replicas.values():
            if st.cores and st.state != "dead":
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
                if await st.handle.start.remote() != dead:
                    return
                await asyncio.sleep(0.5)
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.5)  # restarting: try again
            except ray.exceptions.RayActorError as e:
                log.warning("replica %s is gone for good (%s); replacing it", st.name, e)
                ray.kill(st.handle, no_restart=True)
                self.replicas.pop(st.name, None)
                self._create(died_at=st.died_at or time.monotonic())
                return
            except Exception as e:  # the engine itself failed to start (bad model, too small a pool)
                log.error("replica %s failed to start its engine: %s", st.name, e)
                st.state, st.error = "failed", str(e)[-500:]
                return

    async def _drain(self, st: ReplicaState, timeout_s: float = 60) -> ReplicaReport | None:
        st.state = "draining"
        final = None
        try:
            final = await asyncio.wait_for(st.handle.drain.remote(timeout_s), timeout_s + 10)
            await asyncio.wait_for(st.handle.shutdown.remote(), 30)
        except Exception as e:  # a dead replica has nothing to drain
            log.warning("replica %s: drain failed: %s", st.name, e)
        ray.kill(st.handle, no_restart=True)
        self.replicas.pop(st.name, None)
        return final

    # ------------------------------------------------------------------ reports and health
    async def report(self, name: str, r: ReplicaReport) -> None:
        st = self.replicas.get(name)
        if st is None or st.state in ("draining", "failed"):
            return
        if st.report.incarnation != r.incarnation:  # a new process or engine: old promises are void
            self._void_promises(name)
        for rid in r.pool.admitted:
            p = self.promises.get(rid)
            if p is not None and p.replica == name:
                del self.promises[rid]
        st.report, st.reported_at = r, time.monotonic()
        if st.state in ("starting", "dead") and r.healthy:
            st.state = "healthy"
            if st.died_at is not None:
                self.recoveries.append(time.monotonic() - st.died_at)
                log.info("replica %s serving again %.1fs after its death", name, self.recoveries[-1])
                st.died_at = None
        elif not r.healthy and st.state in ("healthy", "dead") and st.restarted != r.incarnation:
            # The process is alive but its engine died (it may have been marked dead already for reports
            # that stopped while its engine went down): restart the process, once per incarnation.
            log.warning("replica %s is not serving (%s); restarting its process", name, r.error or "no engine")
            st.state, st.died_at = "dead", st.died_at or time.monotonic()
            self._void_promises(name)
            st.restarted = r.incarnation
            self._restart_process(st)

    def _restart_process(self, st: ReplicaState) -> None:
        """A fresh process and engine for a replica whose engine died: Ray restarts the killed actor
        (``max_restarts``; if exhausted, ``_start_replica`` replaces it) and ``_start_replica`` starts it,
        waiting past the dying incarnation."""
        ray.kill(st.handle, no_restart=False)
        if st.task is not None and not st.task.done():
            st.task.cancel()  # a start that may take the dying process for a started one
        st.task = asyncio.ensure_future(self._start_replica(st, dead=st.report.incarnation))

    def _void_promises(self, name: str) -> None:
        self.promises = {k: p for k, p in self.promises.items() if p.replica != name}

    def _prune_placements(self) -> None:
        if any(name not in self.replicas for _, name in self.placements):
            self.placements = collections.Counter({k: n for k, n in self.placements.items() if k[1] in self.replicas})

    def _expire_promises(self, now: float) -> None:
        ttl = self.cfg.placement.promise_ttl_s
        if any(now - p.at > ttl for p in self.promises.values()):
            self.promises = {k: p for k, p in self.promises.items() if now - p.at <= ttl}

    async def mark_failed(self, name: str, why: str = "call failed") -> None:
        st = self.replicas.get(name)
        if st is not None and st.state in ("healthy", "starting"):
            log.warning("replica %s marked dead: %s", name, why)
            st.state, st.died_at = "dead", time.monotonic()
            self._void_promises(name)
            if st.task is None or st.task.done():
                st.task = asyncio.ensure_future(self._start_replica(st))

    async def _monitor(self) -> None:
        next_scale = 0.0
        while True:
            try:
                now = time.monotonic()
                for st in list(self.replicas.values()):
                    quiet = now - max(st.reported_at, st.alive_at)
                    if st.state == "healthy" and quiet > self.cfg.placement.dead_after_s:
                        if st.probe is None or st.probe.done():
                            st.probe = asyncio.ensure_future(self._probe(st, now - st.reported_at))
                if now >= next_scale:
                    next_scale = now + 1.0
                    self._expire_promises(now)
                    self._prune_placements()
                    if self.cfg.autoscaling.enabled:
                        self._autoscale(now)
                self._reconcile()
            except Exception:
                log.exception("controller monitor")
            await asyncio.sleep(0.25)

    async def _probe(self, st: ReplicaState, silent_s: float) -> None:
        """A replica silent for dead_after_s: a report waits for its engine's step (long prefills on a busy CPU
        take seconds), so ask the actor itself before calling it dead. Engine death is reported, not silent."""
        try:
            await asyncio.wait_for(st.handle.ping.remote(), timeout=min(5.0, self.cfg.placement.dead_after_s))
            st.alive_at = time.monotonic()
            log.info("replica %s: no report for %.1fs, but it answers: busy, not dead", st.name, silent_s)
        except Exception as e:  # no answer, or the actor is gone
            await self.mark_failed(st.name, f"no report for {silent_s:.1f}s and no answer ({type(e).__name__})")

    # ------------------------------------------------------------------ scaling
    def _limit(self) -> int:
        """Replicas this deployment can hold: on one machine, what its CPUs allow."""
        return self.replica_limit()[0]

    def replica_limit(self) -> tuple[int, str]:
        """The most replicas this deployment may run, and what sets that limit (for error messages)."""
        most = self.cfg.autoscaling.max_replicas
        limit = (most, f"autoscaling.max_replicas is {most}")
        if self.local and self.cfg.replica.num_cpus > 0:
            cpus = ray.cluster_resources().get("CPU", 1)
            fit = max(1, math.floor(cpus / self.cfg.replica.num_cpus))
            if fit < most:
                limit = (
                    fit,
                    f"this machine's {cpus:g} CPUs hold {fit} of replica.num_cpus {self.cfg.replica.num_cpus:g}",
                )
        return limit

    def _autoscale(self, now: float) -> None:
        d = self.autoscaler.decide(now, self._views(), self.target, self._limit())
        if d is not None:
            log.info("autoscaler: %d -> %d replicas: %s", d.from_replicas, d.to_replicas, d.reason)
            self.decisions.append({**d._asdict(), "time": time.time()})
            self.decision_counts["out" if d.to_replicas > d.from_replicas else "in", "autoscaler"] += 1
            self._set_target(d.to_replicas)

    def _set_target(self, n: int) -> None:
        self.target = n
        ac = self.cfg.autoscaling
        if ac.request_resources == "always" or (ac.request_resources == "auto" and not self.local):
            request_cluster_resources(n, self.cfg.replica.num_cpus, self.cfg.replica.num_gpus)

    async def scale(self, n: int) -> int:
        """Set the target; raises ValueError outside [1, replica_limit()] (the gateway checks first)."""
        limit, why = self.replica_limit()
        if not 1 <= n <= limit:
            raise ValueError(f"replicas must be between 1 and {limit} ({why})")
        self.decisions.append(
            {"time": time.time(), "from_replicas": self.target, "to_replicas": n, "reason": "manual (vtoken scale)"}
        )
        if n != self.target:
            self.decision_counts["out" if n > self.target else "in", "manual"] += 1
        self._set_target(n)
        return n

    def _reconcile(self) -> None:
        active = [st for st in self.replicas.values() if st.state != "draining"]
        for _ in range(self.target - len(active)):
            self._create()
        if len(active) > self.target:  # drain the least busy (a dead one first)
            order = sorted(active, key=lambda s: (s.state == "healthy", s.report.pool.running))
            for st in order[: len(active) - self.target]:
                self._spawn(self._drain(st))

    def _spawn(self, coro) -> None:
        """Run ``coro`` in the background, holding a reference until it is done (asyncio keeps only weak ones)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ placement
    def _views(self) -> list[ReplicaView]:
        now, promised = time.monotonic(), collections.Counter()
        for p in self.promises.values():
            promised[p.replica] += p.blocks
        return [
            ReplicaView(
                st.name,
                p.free_blocks,
                p.total_blocks,
                promised[st.name],
                p.running,
                p.waiting,
                p.blocks_reclaimed,
                now - st.reported_at > self.cfg.placement.stale_after_s,
            )
            for st in self.replicas.values()
            if st.state == "healthy"
            for p in (st.report.pool,)
        ]

    async def place(self, request_id: str, need_blocks: int, exclude: tuple[str, ...] = ()) -> tuple | None:
        """(name, handle) of the replica chosen for the request, or None if no replica can take it now."""
        views = [v for v in self._views() if v.name not in exclude]
        if not views:
            return None
        v = self.strategy.choose(views, need_blocks)
        self.promises[request_id] = Promise(v.name, need_blocks, time.monotonic())
        self.placements[self.cfg.placement.strategy, v.name] += 1
        return v.name, self.replicas[v.name].handle

    async def set_placement(self, strategy: str) -> None:
        """Switch the strategy live (side-by-side measurements on the same replicas)."""
        self.strategy = make_strategy(strategy)
        self.cfg = self.cfg.model_copy(
            update={"placement": self.cfg.placement.model_copy(update={"strategy": strategy})}
        )

    async def finished(self, request_id: str) -> None:
        """The request is over (done, failed or cancelled): whatever it held is free or will be reported so."""
        self.promises.pop(request_id, None)

    async def status(self) -> dict[str, Any]:
        from cluster.status import cluster_status

        return cluster_status(self)

    async def snapshot(self):
        """Every replica's state, last report and promised blocks, and the cumulative placement and scaling
        counts (cluster.snapshot.ClusterSnapshot): what /metrics and the capacity stream read."""
        from cluster.snapshot import take_snapshot

        return take_snapshot(self)
