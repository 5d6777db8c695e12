"""Controller: a Ray actor that owns the replicas, aggregates their reports and keeps the account of placements.

Replica statuses and their transitions: cluster/control/replica_status.py; creating, starting, probing, restarting and
draining replicas: cluster/control/lifecycle.py (``ReplicaLifecycle``, which this class holds as ``lifecycle``). Here:
reports, promises, placement and scaling, and the one snapshot (cluster/control/snapshot.py) that status, ``/metrics``,
the capacity stream, placement and the autoscaler all read.
Promises: a request placed on a replica counts its estimated blocks against it until a report of that replica
lists it as admitted (that report's ``free_blocks`` counts its blocks) or until the request ends, whichever
is first. Dropping it at the first token instead would count its blocks twice while they are allocated but
unreported (prefill), or not at all when the report is older than the admission. A replica that stops serving
loses its promises (``ReplicaLifecycle.transition`` calls ``_forget``). A gateway places most requests itself from the
views it asks for (``placement_state``; cluster/placement/placer.py) and tells each placement here (``promise``); this
controller places the rest (``place``).

A controller that dies is restarted by Ray (``max_restarts``, on the node of `vtoken serve`: cluster/server.py)
under the same actor id, so the gateway's and the replicas' handles keep working. The new incarnation knows
nothing: at its first call it takes over every live replica of the service by name (``lifecycle.recover``), and from
their reports (the next within a second) it knows again which serve, how full they are and where they run.
Meanwhile the replicas keep serving what they have; new requests wait for placement (the gateway retries for
``gateway.place_timeout_s``). Promises and counters start again from zero; the target replica count becomes the
replicas found (a `vtoken scale` or an autoscaler decision made before the restart is kept so).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Any, NamedTuple

import ray

from actors.report import ReplicaReport, prefix_capacity
from cluster.config import ServeConfig
from cluster.control.autoscaler import Autoscaler, request_cluster_resources
from cluster.control.lifecycle import ReplicaLifecycle, ReplicaState, engine_factory, replica_env, replica_prefix
from cluster.control.replica_status import ReplicaStatus
from cluster.control.snapshot import ClusterSnapshot, replica_views, take_snapshot
from cluster.placement.placer import PlacementState
from cluster.placement.prefix_index import PrefixIndex, with_prefix
from cluster.placement.strategies import ReplicaView, check_fits, make_strategy

log = logging.getLogger("vtoken.controller")
__all__ = ["Controller", "Promise", "ReplicaState", "replica_env"]
ADOPT_WINDOW_S = 120.0  # after a restart, a report from a replica not taken over yet takes it over this long
SETTLED = 4096  # request ids kept as admitted or ended, for promises that arrive after
GATEWAYS = 64  # gateways whose last promise is kept


class Promise(NamedTuple):
    """Blocks a placed request counts against its replica until a report counts them (or it ends), and the
    tokens it will read and generate (its prompt and max_tokens), counted as work left there meanwhile."""

    replica: str
    blocks: int
    at: float  # time.monotonic() of the placement
    tokens: int = 0


class Controller:
    """The Ray actor that owns the replicas (through ``lifecycle``), takes their reports, keeps the promises and
    places and scales. ``replicas`` (name -> ReplicaState) is shared with ``lifecycle``, which alone adds and
    removes replicas and changes their status."""

    def __init__(self, cfg: dict[str, Any], local: bool = True):
        self.cfg = ServeConfig(**cfg)
        self.local = local
        self.strategy = make_strategy(self.cfg.placement.strategy)
        self.autoscaler = Autoscaler(self.cfg.autoscaling)
        self.replicas: dict[str, ReplicaState] = {}
        self.lifecycle = ReplicaLifecycle(self.cfg, engine_factory(self.cfg), self.replicas, self._forget)
        self.target = self.cfg.replicas
        # Every structure here is bounded however long the deployment runs: promises end with their request,
        # with a report that counts them, with their replica, or after promise_ttl_s (a request whose end the
        # controller never heard of: a gateway gone, a lost message); the rest keep the last few entries.
        self.promises: dict[str, Promise] = {}
        # A gateway's promise that arrives after its request's admission (a report) or its end is not counted: such
        # requests, the last SETTLED (admitted with no promise here, or ended past the gateway's last promise heard
        # of). Per gateway (the last GATEWAYS), the last of its promises heard of.
        self.settled: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self.acked: collections.OrderedDict[str, int] = collections.OrderedDict()
        # What each serving replica's prefix cache holds (its reports' deltas), dropped when it stops serving.
        self.prefix: dict[str, PrefixIndex] = {}
        self.decisions: collections.deque = collections.deque(maxlen=50)
        # Cumulative counts for /metrics: placements by (strategy, replica), pruned to live replicas each
        # second; scaling decisions by (direction, trigger), four keys at most.
        self.placements: collections.Counter[tuple[str, str]] = collections.Counter()
        self.decision_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._tasks: set[asyncio.Future] = set()  # fire-and-forget work (drains), held until done
        self._loop: asyncio.Task | None = None
        self.stopping = False  # shutdown began: nothing is created or taken over any more
        self.where = _where()  # (node ip, node id, pid) of this controller, for vtoken status
        self.restarted = _reconstructed()  # Ray restarted this actor: take over the live replicas first
        self.adopt_until = 0.0

    def _ensure_running(self) -> None:
        """After a restart: the live replicas taken over, then the monitor loop started (so that the loop does not
        start new replicas in their place). Called at the top of every call, because a restarted controller gets
        no ``start()``: its first call comes from a replica's report or the gateway within a second. A controller
        that was not restarted starts its loop in ``start()``."""
        if not self.restarted or self._loop is not None or self.stopping:
            return
        found = self.lifecycle.recover()
        self.target = max(found, 1) if found else self.target
        self.adopt_until = time.monotonic() + ADOPT_WINDOW_S
        log.warning("controller restarted: took over %d live replicas; target %d", found, self.target)
        self._loop = asyncio.ensure_future(self._monitor())

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float = 600) -> int:
        """Create the replicas and wait until ``target`` of them are healthy; returns how many are."""
        self._ensure_running()
        if self._loop is None:
            self._reconcile()
            self._loop = asyncio.ensure_future(self._monitor())
        t_end = time.monotonic() + timeout_s
        count = self.lifecycle.count
        while count(ReplicaStatus.HEALTHY) < self.target and time.monotonic() < t_end:
            if count(ReplicaStatus.FAILED):
                raise RuntimeError(next(st.error for st in self.replicas.values() if st.state is ReplicaStatus.FAILED))
            await asyncio.sleep(0.2)
        return count(ReplicaStatus.HEALTHY)

    async def progress(self) -> list[dict[str, str]]:
        """Each replica's state and, before it serves, what it is doing or why it failed (vtoken serve's start)."""
        self._ensure_running()
        return [
            {
                "name": st.name,
                "state": str(st.state),
                "phase": st.phase,
                "error": st.error,
                "node_ip": st.report.node_ip,
            }  # fmt: skip
            for st in self.replicas.values()
        ]

    async def shutdown(self, timeout_s: float = 30) -> list[ReplicaReport]:
        """Drain every replica and kill it; returns each replica's final report (all blocks free)."""
        self.stopping = True
        if self._loop:
            self._loop.cancel()
        drain = self.lifecycle.drain
        finals = await asyncio.gather(*(drain(st, timeout_s, "shutdown") for st in list(self.replicas.values())))
        return [f for f in finals if f]

    # ------------------------------------------------------------------ reports and promises
    async def report(self, name: str, r: ReplicaReport) -> bool:
        """A replica's report. True asks it for a snapshot of its prefix cache with its next report (its delta did
        not follow the last one applied: cluster/placement/prefix_index.py)."""
        self._ensure_running()
        st = self.replicas.get(name)
        adopt = st is None and self._may_adopt(name)
        if adopt and self.lifecycle.adopt(name, "it reported after a controller restart"):
            st = self.replicas[name]
        if st is None or not st.state.takes_reports():
            return False
        if r.draining and st.state is not ReplicaStatus.DRAINING:  # the incarnation before a restart was draining it
            self._spawn(self.lifecycle.drain(st, why="it was draining when the controller restarted"))
            return False
        if st.report.incarnation != r.incarnation:  # a new process or engine: old promises and cache are void
            self._forget(name)
        for rid in r.pool.admitted:
            p = self.promises.get(rid)
            if p is None:  # placed by a gateway whose promise has not arrived yet (or one that expired)
                self._settle(rid, name)
            elif p.replica == name:
                del self.promises[rid]
        st.report, st.reported_at = r, time.monotonic()
        self.lifecycle.on_health(st, r)
        return self._prefix_report(name, r)

    def _prefix_report(self, name: str, r: ReplicaReport) -> bool:
        """Apply the report's prefix delta to the replica's index (made at its first delta while it serves)."""
        st = self.replicas.get(name)
        if r.prefix is None or st is None or not st.state.serving():
            return False
        index = self.prefix.get(name)
        if index is None:
            index = self.prefix[name] = PrefixIndex(prefix_capacity(r.pool.total_blocks))
        if index.apply(r.prefix):
            return False
        log.info("replica %s: prefix delta %d does not follow %d; asking for a snapshot", name, r.prefix.seq,
                 index.seq)  # fmt: skip
        return True

    def _forget(self, name: str) -> None:
        """The replica stopped serving, was removed, or came back as a new process or engine: its promises are void
        and what its prefix cache held is forgotten."""
        self.promises = {k: p for k, p in self.promises.items() if p.replica != name}
        self.prefix.pop(name, None)

    def _may_adopt(self, name: str) -> bool:
        return (
            not self.stopping and time.monotonic() < self.adopt_until and name.startswith(replica_prefix(self.cfg.name))
        )

    def _prune_placements(self) -> None:
        if any(name not in self.replicas for _, name in self.placements):
            self.placements = collections.Counter({k: n for k, n in self.placements.items() if k[1] in self.replicas})

    def _expire_promises(self, now: float) -> None:
        ttl = self.cfg.placement.promise_ttl_s
        if any(now - p.at > ttl for p in self.promises.values()):
            self.promises = {k: p for k, p in self.promises.items() if now - p.at <= ttl}

    async def _monitor(self) -> None:
        next_scale = 0.0
        while True:
            try:
                now = time.monotonic()
                self.lifecycle.probe_silent(now)
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
        views = replica_views(take_snapshot(self), self.cfg.placement.stale_after_s)  # what status shows
        d = self.autoscaler.decide(now, views, self.target, self._limit())
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
        if self.stopping:
            return
        active = [st for st in self.replicas.values() if st.state.active()]
        for _ in range(self.target - len(active)):
            self.lifecycle.create()
        if len(active) > self.target:  # drain the least busy (a dead one first)
            order = sorted(active, key=lambda s: (s.state.serving(), s.report.pool.running))
            for st in order[: len(active) - self.target]:
                self._spawn(self.lifecycle.drain(st))

    def _spawn(self, coro) -> None:
        """Run ``coro`` in the background, holding a reference until it is done (asyncio keeps only weak ones)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ placement
    def _views(self) -> list[ReplicaView]:
        """The serving replicas as placement sees them: from the same snapshot as everything else."""
        return replica_views(take_snapshot(self), self.cfg.placement.stale_after_s)

    async def place(
        self,
        request_id: str,
        need_blocks: int,
        exclude: tuple[str, ...] = (),
        tokens: int = 0,
        prefix: tuple[int, ...] = (),
    ) -> tuple | None:
        """(name, handle) of the replica chosen for the request, or None if no replica can take it now.
        ``tokens``: the request's prompt and max_tokens (work the replica's reports do not count yet); ``prefix``:
        its prompt's block hashes (vtoken/prefix_hash.py), matched against each replica's prefix cache."""
        self._ensure_running()
        views = with_prefix((v for v in self._views() if v.name not in exclude), self.prefix, prefix)
        if not views:
            return None
        check_fits(views, need_blocks)
        v = self.strategy.choose(views, need_blocks)
        self.promises[request_id] = Promise(v.name, need_blocks, time.monotonic(), tokens)
        self.placements[self.cfg.placement.strategy, v.name] += 1
        return v.name, self.replicas[v.name].handle

    async def placement_state(
        self, gateway: str, known: tuple[str, ...] = (), copies: dict[str, tuple[int, int]] | None = None
    ) -> PlacementState:
        """What ``gateway`` places from (cluster/placement/placer.py): the serving replicas' views (every promise heard
        of counted), the strategy, the last of the gateway's promises heard of, and the handles of the serving replicas
        it does not name in ``known``. Under a strategy that reads the prefix indexes, also what the gateway's
        copies of them, at the (epoch, version) ``copies`` gives per replica, need to equal them."""
        self._ensure_running()
        views = tuple(self._views())
        handles = {v.name: self.replicas[v.name].handle for v in views if v.name not in known}
        prefix = None
        if self.strategy.reads_prefix:
            have = copies or {}
            indexed = [v.name for v in views if v.name in self.prefix]
            prefix = {n: self.prefix[n].since(*have.get(n, (0, 0))) for n in indexed}
        return PlacementState(views, self.cfg.placement.strategy, self.acked.get(gateway, 0), handles, prefix)

    async def promise(
        self, gateway: str, seq: int, request_id: str, name: str, need_blocks: int, tokens: int, strategy: str
    ) -> None:
        """``gateway`` placed the request on replica ``name`` (its ``seq``-th placement): counted as ``place``
        counts its own, unless the replica stopped serving or the request was admitted or ended already."""
        self._ensure_running()
        self.acked[gateway] = max(seq, self.acked.get(gateway, 0))
        self.acked.move_to_end(gateway)
        if len(self.acked) > GATEWAYS:
            self.acked.popitem(last=False)
        st = self.replicas.get(name)
        late = (request_id, name) in self.settled or (request_id, "") in self.settled
        if st is None or not st.state.serving() or late:
            return
        self.promises[request_id] = Promise(name, need_blocks, time.monotonic(), tokens)
        self.placements[strategy, name] += 1

    def _settle(self, request_id: str, replica: str = "") -> None:
        """The request was admitted by ``replica``, or ended (no replica: wherever it was)."""
        self.settled[request_id, replica] = None
        if len(self.settled) > SETTLED:
            self.settled.popitem(last=False)

    async def set_placement(self, strategy: str) -> None:
        """Switch the strategy live (side-by-side measurements on the same replicas)."""
        self.strategy = make_strategy(strategy)
        self.cfg = self.cfg.model_copy(
            update={"placement": self.cfg.placement.model_copy(update={"strategy": strategy})}
        )
        self.lifecycle.cfg = self.cfg

    async def finished(self, request_id: str, gateway: str = "", seq: int = 0) -> None:
        """The request is over (done, failed or cancelled): whatever it held is free or will be reported so.
        ``gateway`` and ``seq``: the gateway placed it as its ``seq``-th promise, which may not have arrived yet."""
        if gateway and seq > self.acked.get(gateway, 0):
            self._settle(request_id)
        self.promises.pop(request_id, None)

    async def mark_failed(self, name: str, why: str = "call failed") -> None:
        """A gateway's call to replica ``name`` failed: dead, and restarted (``ReplicaLifecycle.mark_failed``)."""
        await self.lifecycle.mark_failed(name, why)

    async def status(self) -> dict[str, Any]:
        from cluster.control.status import cluster_status

        self._ensure_running()
        return cluster_status(take_snapshot(self))

    async def snapshot(self) -> ClusterSnapshot:
        """Every replica's status, last report and promised blocks, and the cumulative placement and scaling
        counts (cluster.control.snapshot.ClusterSnapshot): what /metrics and the capacity stream read."""
        self._ensure_running()
        return take_snapshot(self)


def _reconstructed() -> bool:
    """Whether this is a Ray actor that Ray restarted (False outside an actor, as in unit tests)."""
    try:
        ctx = ray.get_runtime_context()
        return bool(ctx.get_actor_id()) and bool(ctx.was_current_actor_reconstructed)
    except Exception:
        return False


def _where() -> tuple[str, str, int]:
    """Where this controller runs: its node's address and id, and its process (no node outside Ray)."""
    import os

    try:
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()
    except Exception:
        return "", "", os.getpid()
