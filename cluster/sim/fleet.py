"""The fleet's event loop: arrivals placed by ``cluster/placement/strategies.py``, replicas stepping, reports, the
``cluster/control/autoscaler.py`` Autoscaler deciding the replica count. The strategy and the autoscaler are the
project's own objects (``make_strategy``, ``Autoscaler.decide``), called with ``ReplicaView``s as the
controller builds them; nothing of them is copied here.

What the controller sees of a replica (its ``ReplicaView``) is its last report. A replica reports after every
step (on the real cluster a report goes out whenever free blocks move by 5% of a small pool, which on the
pools simulated here is nearly every step) and at least every ``report_interval_s`` during a decode run.
A placed request's estimated blocks count as ``promised`` on its replica until a report shows it admitted, or
it ends (``cluster/control/controller.py``: ``place``, ``report``, ``finished``).

With ``prefix_cache``, each replica keeps a prefix cache (``prefix_cache.py``) and each report applies its delta to
the controller's ``cluster/placement/prefix_index.py`` PrefixIndex of it, from which placement sees each replica's
leading hit for the request it places; a conversation's next turn arrives its think time after the last one ended.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from actors.report import prefix_capacity
from cluster.config import AutoscalingConfig
from cluster.control.autoscaler import Autoscaler
from cluster.placement.prefix_index import PrefixIndex
from cluster.placement.strategies import ReplicaView, make_strategy
from cluster.sim.calibration import Calibration
from cluster.sim.oracle import SIM_STRATEGIES
from cluster.sim.replica import Limits, Replica, Seq
from cluster.sim.workload import Request
from vtoken.core.budget import peak_blocks


@dataclass(frozen=True)
class FleetConfig:
    """``pools``: blocks of each replica, in creation order, cycled (replicas of different sizes).
    ``estimate_with_budget``: the gateway's estimate counts the eviction budget (requests that carry their
    eviction options); off, as for ``vtoken bench goodput``'s requests, the estimate is the whole context."""

    strategy: str = "free_blocks"
    mode: str = "vtoken"
    replicas: int = 2
    pools: tuple[int, ...] = (44,)
    prefill_chunk: int | None = None
    autoscaling: AutoscalingConfig | None = None
    start_s: float = 30.0  # a new replica serves this long after the decision
    tick_s: float = 1.0  # the controller's autoscaling period
    report_interval_s: float = 1.0
    estimate_with_budget: bool = False
    budget: float = 0.5
    sink: int = 4
    recent: int = 16
    seed: int = 0
    check: bool = False  # tests: every replica's check_integrity() after every event
    prefix_cache: bool = False  # replicas keep prefix caches, reported to placement (conversations' workloads)


@dataclass
class Outcome:
    """Per request: replica, first token, end; ``ok`` = completed within its deadline."""

    done: dict[int, float] = field(default_factory=dict)
    first: dict[int, float] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)
    placed_on: dict[int, str] = field(default_factory=dict)
    hit: dict[int, int] = field(default_factory=dict)  # prompt tokens a completed request read from the prefix cache
    arrived: dict[int, float] = field(default_factory=dict)  # a conversation's later turns arrive as the run goes
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas alive) at each change
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)
    preemptions: int = 0


class Fleet:
    def __init__(self, cfg: FleetConfig, cal: Calibration):
        self.cfg, self.cal = cfg, cal
        sim_only = SIM_STRATEGIES.get(cfg.strategy)
        self.strategy = sim_only() if sim_only else make_strategy(cfg.strategy)
        if hasattr(self.strategy, "rng"):  # power_of_two draws at random: the same seed, the same run
            self.strategy.rng.seed(cfg.seed)
        self.autoscaler = Autoscaler(cfg.autoscaling) if cfg.autoscaling and cfg.autoscaling.enabled else None
        self.limits = Limits(
            cal.block_size,
            cal.max_num_batched_tokens,
            cal.max_num_seqs,
            cfg.prefill_chunk,
            cal.meta.get("budget", cfg.budget) if cfg.mode != "off" else None,
            cfg.sink + cfg.recent,
        )
        self.steps = cal.steps(cfg.mode)
        self.profiles = {pe: cal.profile(cfg.mode, pe, cfg.prefill_chunk) for pe in (True, False)}
        self.replicas: dict[str, Replica] = {}
        self.healthy: dict[str, ReplicaView] = {}  # views placement and the autoscaler see
        self.draining: set[str] = set()
        self.promised: dict[str, int] = {}  # replica -> blocks promised to requests no report counts yet
        self.pending: dict[str, int] = {}  # replica -> those requests
        self.promised_tokens: dict[str, int] = {}  # replica -> their prompt + max_tokens
        self.reported_tokens: dict[str, int] = {}  # replica -> tokens to go of its running requests, last report
        self.promises: dict[int, tuple[str, int, int]] = {}
        self.index: dict[str, PrefixIndex] = {}  # the controller's index of each replica's prefix cache
        self.seqs: dict[int, Seq] = {}
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq_no = itertools.count()
        self.versions: dict[str, int] = {}
        self.target = cfg.replicas
        self.names = itertools.count(1)
        self.out = Outcome()
        self.now = 0.0

    # ------------------------------------------------------------------ events
    def _at(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self.seq_no), kind, payload))

    def run(self, reqs: list[Request], until: float | None = None) -> Outcome:
        for _ in range(self.cfg.replicas):
            self._create(ready_in=0.0)
        for r in reqs:
            self._arrival(r)
        last = max((r.arrival + sum(t.think_s for t in r.turns()) for r in reqs), default=0.0)
        horizon = until if until is not None else last + 3600
        if self.autoscaler:
            self._at(self.cfg.tick_s, "tick")
        handlers = {
            "arrive": self._arrive,
            "step": self._step_end,
            "deadline": self._deadline,
            "ready": self._ready,
            "tick": self._tick,
            "heartbeat": self._heartbeat,
        }
        self.left = len(reqs)  # requests not yet ended (done or cancelled)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > horizon:
                break
            self.now = t
            handlers[kind](payload)
            if self.cfg.check:
                for rep in self.replicas.values():
                    rep.check_integrity()
            if self.left == 0 and until is None:
                break
        self.out.replicas.append((self.now, len(self.replicas)))
        self.out.preemptions += sum(r.preemptions for r in self.replicas.values())
        return self.out

    def _arrival(self, r: Request) -> None:
        self.out.arrived[r.id] = r.arrival
        self._at(r.arrival, "arrive", r)
        if r.deadline_s is not None:
            self._at(r.arrival + r.deadline_s, "deadline", r.id)

    def _arrive(self, r: Request) -> None:
        views = list(self.healthy.values())
        if not views:  # no replica serves yet: the gateway retries; modelled as a retry 0.1 s later
            self._at(self.now + 0.1, "arrive", r)
            return
        c = self.cfg
        budgeted = (c.budget, c.sink, c.recent, c.prefill_chunk, r.prefill_evict) if c.estimate_with_budget else ()
        need = peak_blocks(r.prompt, r.output, self.cal.block_size, *budgeted)
        if r.prefix and c.prefix_cache:
            views = [v._replace(prompt_blocks=len(r.prefix), prefix_blocks=self._hit(v.name, r.prefix)) for v in views]
        name = self.strategy.choose(views, need).name
        self.out.placed_on[r.id] = name
        work = r.prompt + r.output
        self.promises[r.id] = (name, need, work)
        self._promise(name, need, 1, work)
        rep = self.replicas[name]
        s = Seq(r, self.profiles[r.prefill_evict])
        self.seqs[r.id] = s
        rep.waiting.append(s)
        self._kick(rep)

    def _kick(self, rep: Replica) -> None:
        """The replica's scheduler sees a change: plan now if idle, else end a decode run at its next step."""
        if not rep.busy:
            self._plan(rep)
        else:
            t = rep.interrupt(self.now)
            if t is not None:
                self._schedule_end(rep, t)

    def _plan(self, rep: Replica) -> None:
        t = rep.plan(self.now)
        if t is not None:
            self._schedule_end(rep, t)
            if rep.run is not None:
                self._at(self.now + self.cfg.report_interval_s, "heartbeat", (rep.name, self.versions[rep.name]))
        self._report(rep)

    def _schedule_end(self, rep: Replica, t: float) -> None:
        v = self.versions[rep.name] = self.versions.get(rep.name, 0) + 1
        self._at(t, "step", (rep.name, v))

    def _step_end(self, payload) -> None:
        name, v = payload
        rep = self.replicas.get(name)
        if rep is None or self.versions.get(name) != v:
            return  # a decode run cut short: its old end is void
        for s in rep.finish_step(self.now):
            self._ended(s)
        self._plan(rep)
        if name in self.draining and rep.idle():
            self._remove(name)

    def _heartbeat(self, payload) -> None:
        name, v = payload
        rep = self.replicas.get(name)
        if rep is None or self.versions.get(name) != v or rep.run is None:
            return
        rep.sync(self.now)
        self._report(rep)
        self._at(self.now + self.cfg.report_interval_s, "heartbeat", payload)

    def _deadline(self, rid: int) -> None:
        s = self.seqs.get(rid)
        if s is None or rid in self.out.done or s.cancelled:
            return
        rep = self.replicas[self.out.placed_on[rid]]
        self.out.cancelled.add(rid)
        if rep.cancel(s):
            self._ended(s)
            if not rep.busy:
                self._plan(rep)
        else:
            self._kick(rep)

    def _hit(self, name: str, prefix: tuple[int, ...]) -> int:
        """Leading blocks of ``prefix`` placement sees on ``name``: the controller's index, as its reports left it; a
        strategy that knows every cache (``exact_prefix``) reads the replica's cache itself."""
        if getattr(self.strategy, "exact_prefix", False):
            return self.replicas[name].cache.match(prefix)
        index = self.index.get(name)
        return index.match(prefix) if index is not None else 0

    def _ended(self, s: Seq) -> None:
        rid = s.req.id
        self.left -= 1
        if not s.cancelled:
            self.out.done[rid] = self.now
            self.out.first[rid] = s.first_token_at if s.first_token_at is not None else self.now
            self.out.hit[rid] = s.hit
            nxt = s.req.then
            if nxt is not None:  # the conversation's next turn, after its user's think time
                self.left += 1
                self._arrival(replace(nxt, arrival=self.now + nxt.think_s))
        self._unpromise(rid)
        self.seqs.pop(rid, None)

    # ------------------------------------------------------------------ the controller's view
    def _report(self, rep: Replica) -> None:
        for s in rep.admitted_now:
            self._unpromise(s.req.id)
        rep.admitted_now = []
        if rep.cache is not None and rep.name in self.healthy:
            index = self.index.setdefault(rep.name, PrefixIndex(prefix_capacity(rep.pool)))
            if not index.apply(rep.cache.cut()):
                raise AssertionError(f"{rep.name}: a report's prefix delta was lost in the simulator")
        self.reported_tokens[rep.name] = sum(s.req.prompt - s.read + s.req.output - s.out for s in rep.running)
        if rep.name in self.healthy:
            self.healthy[rep.name] = ReplicaView(
                rep.name,
                rep.free,
                rep.pool,
                self.promised.get(rep.name, 0),
                len(rep.running),
                len(rep.waiting),
                pending=self.pending.get(rep.name, 0),
                tokens_to_go=self._work(rep.name),
            )

    def _promise(self, name: str, blocks: int, requests: int = 1, tokens: int = 0) -> None:
        self.promised[name] = self.promised.get(name, 0) + blocks
        self.pending[name] = self.pending.get(name, 0) + requests
        self.promised_tokens[name] = self.promised_tokens.get(name, 0) + tokens
        if name in self.healthy:
            self.healthy[name] = self.healthy[name]._replace(
                promised=self.promised[name],
                pending=self.pending[name],
                tokens_to_go=self._work(name),
            )

    def _work(self, name: str) -> int:
        """Tokens to go on ``name`` as placement sees them: its last report's, plus its promised requests'."""
        return self.reported_tokens.get(name, 0) + self.promised_tokens.get(name, 0)

    def _unpromise(self, rid: int) -> None:
        p = self.promises.pop(rid, None)
        if p is not None:
            self._promise(p[0], -p[1], -1, -p[2])

    # ------------------------------------------------------------------ replicas and autoscaling
    def _create(self, ready_in: float) -> None:
        i = next(self.names)
        name = f"r{i:04d}"
        pool = self.cfg.pools[(i - 1) % len(self.cfg.pools)]
        self.replicas[name] = Replica(name, pool, self.limits, self.steps, self.cfg.prefix_cache)
        self.out.replicas.append((self.now, len(self.replicas)))
        self._at(self.now + ready_in, "ready", name)

    def _ready(self, name: str) -> None:
        rep = self.replicas.get(name)
        if rep is not None and name not in self.draining:
            self.healthy[name] = ReplicaView(name, rep.free, rep.pool)
            self._report(rep)

    def _remove(self, name: str) -> None:
        rep = self.replicas.pop(name)
        self.index.pop(name, None)
        self.out.preemptions += rep.preemptions
        self.draining.discard(name)
        self.out.replicas.append((self.now, len(self.replicas)))

    def _tick(self, _) -> None:
        self._at(self.now + self.cfg.tick_s, "tick")
        d = self.autoscaler.decide(self.now, list(self.healthy.values()), self.target)
        if d is None:
            return
        self.out.decisions.append((d.time, d.from_replicas, d.to_replicas, d.reason))
        self.target = d.to_replicas
        active = [n for n in self.replicas if n not in self.draining]
        for _ in range(self.target - len(active)):
            self._create(ready_in=self.cfg.start_s)
        if len(active) > self.target:  # drain the least busy, one still starting first (the controller's order)
            order = sorted(active, key=lambda n: (n in self.healthy, len(self.replicas[n].running)))
            for n in order[: len(active) - self.target]:
                self.draining.add(n)
                self.healthy.pop(n, None)
                if self.replicas[n].idle():
                    self._remove(n)
