"""Placement in the gateway: each request is placed from a copy of the controller's replica views held in the
gateway, not by a call to the controller per request, as Ray Serve's router places by the queue lengths it caches.
A request that finds the copy older than ``gateway.placement_refresh_s`` asks for a new one in the background (so
a busy gateway asks about that often, an idle one never). A call per request waits for another process: under
load, that wait was a tenth of a request's time to its first token (docs/clients.md, "What the door costs").

The controller stays the one account of what is promised where. Each placement is told to it at once
(``Controller.promise``, not waited for) with this gateway's sequence number; the views it sends back
(``PlacementState``) count every promise it has heard of, and say up to which number it heard this gateway's. The
gateway adds its own promises past that number, so a burst placed between two refreshes sees every request placed
before it, as with a call per request.

A request that finds the copy older than ``max_age_s`` (the first after a quiet spell) waits for the new one, so
one gateway places with one strategy object (round robin takes turns with one counter). Under a strategy that reads
the replicas' prefix indexes (``prefix``), the copy holds copies of them too, each brought up to date with every
refresh by the changes since (cluster/placement/prefix_index.py): a conversation's next turn, seconds after its last,
finds the blocks its last turn left as the controller's index does. The controller still places a request
(``Controller.place``, as before) when no copy comes (a controller restarting) and when no replica in the copy is
left to try. A strategy switched live (``Controller.set_placement``) reaches the gateway with its next refresh: at
the latest with the first request ``max_age_s`` after the switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, NamedTuple

import ray

from cluster.placement.prefix_index import PrefixIndex, PrefixUpdate, with_prefix
from cluster.placement.strategies import PlacementStrategy, ReplicaView, check_fits, make_strategy, promised_per_replica

log = logging.getLogger("vtoken.gateway")
MAX_AGE_S = 0.5  # the oldest copy placed from, at the default refresh (0.1 s)
# After a change at the controller (a strategy switched, a report with new blocks), the longest until the gateway's
# next request places from a copy that has it, at the default refresh: what a caller that just made one waits.
SETTLE_S = MAX_AGE_S + 0.1


class PlacementState(NamedTuple):
    """What a gateway places from (``Controller.placement_state``): the serving replicas' views, counting every
    promise the controller has heard of; the strategy; the last of this gateway's promises it heard of (``acked``);
    and the handles of serving replicas the gateway did not name as known."""

    views: tuple[ReplicaView, ...]
    strategy: str
    acked: int
    handles: dict[str, Any]
    # Under a strategy that reads prefixes: per serving replica with an index, what the gateway's copy needs (None:
    # nothing). None under the others: the gateway keeps no copies.
    prefix: dict[str, PrefixUpdate | None] | None = None


class Mine(NamedTuple):
    """A promise this gateway made that the controller's last views may not count yet."""

    seq: int
    replica: str
    blocks: int
    tokens: int


class Placer:
    """Invariants: a request placed here is told to the controller with a sequence number larger than any before it;
    ``mine`` holds this gateway's promises in flight that the last views may not count (those past ``acked``), and
    nothing else: a request's entry goes when it ends or when views that count it arrive."""

    def __init__(self, controller: Any, refresh_s: float, max_age_s: float | None = None):
        self.controller, self.refresh_s = controller, refresh_s
        self.max_age_s = max_age_s if max_age_s is not None else max(5 * refresh_s, MAX_AGE_S)
        if self.max_age_s < refresh_s:
            raise ValueError(f"max_age_s {self.max_age_s} is under refresh_s {refresh_s}")
        self.id = uuid.uuid4().hex[:12]  # the controller counts this gateway's promises under it
        self.views: tuple[ReplicaView, ...] = ()
        self.strategy_name = ""
        self.strategy: PlacementStrategy | None = None
        self.handles: dict[str, Any] = {}
        self.prefix: dict[str, PrefixIndex] = {}  # copies of the controller's indexes, under ``prefix``
        self.at: float | None = None  # loop time at which the views were asked for
        self.seq = 0
        self.mine: dict[str, Mine] = {}
        self._task: asyncio.Task | None = None  # the refresh under way

    async def place(
        self, rid: str, need: int, exclude: list[str], tokens: int, prefix: tuple[int, ...] = ()
    ) -> tuple[str, Any] | None:
        """(name, handle) of the replica for the request, told to the controller; None when the controller must
        place it (see the module's docstring). ``prefix``: the prompt's block hashes (vtoken/prefix_hash.py)."""
        loop = asyncio.get_running_loop()
        age = loop.time() - self.at if self.at is not None else None
        if self._task is None and (age is None or age >= self.refresh_s):
            self._task = loop.create_task(self._refresh())
        if age is None or age > self.max_age_s:
            with contextlib.suppress(Exception):  # the refresh logs its own failures
                await asyncio.shield(self._task)  # shared: a request that goes away does not cancel it
            age = loop.time() - self.at if self.at is not None else None
        s = self.strategy
        if s is None or age is None or age > self.max_age_s:
            return None
        views = [v for v in self.views if v.name not in exclude and v.name in self.handles]
        if not views:
            return None
        if s.reads_prefix:
            views = with_prefix(views, self.prefix, prefix)
        if self.mine:
            blocks, count, work = promised_per_replica(self.mine.values())
            views = [v._replace(promised=v.promised + blocks[v.name], pending=v.pending + count[v.name],
                                tokens_to_go=v.tokens_to_go + work[v.name]) for v in views]  # fmt: skip
        check_fits(views, need)
        v = s.choose(views, need)
        self.seq += 1
        self.mine[rid] = Mine(self.seq, v.name, need, tokens)
        with contextlib.suppress(ray.exceptions.RayError):  # a controller restarting: it rebuilds from reports
            self.controller.promise.remote(self.id, self.seq, rid, v.name, need, tokens, self.strategy_name)
        return v.name, self.handles[v.name]

    def finished(self, rid: str) -> tuple[str, int] | tuple[()]:
        """The request ended: what the controller's ``finished`` needs to know of its promise if the last views did
        not count it (the promise may arrive after the end)."""
        m = self.mine.pop(rid, None)
        return (self.id, m.seq) if m is not None else ()

    def lost(self, name: str) -> None:
        """A replica that died under a request: none goes there until views that still show it alive arrive."""
        self.handles.pop(name, None)

    def apply(self, st: PlacementState, asked_at: float) -> None:
        """New views from the controller (asked for at loop time ``asked_at``)."""
        names = {v.name for v in st.views}
        self.handles = {n: h for n, h in {**self.handles, **st.handles}.items() if n in names}
        self.views = st.views
        if st.strategy != self.strategy_name:
            self.strategy, self.strategy_name = make_strategy(st.strategy), st.strategy
        copies = {}  # the replicas without an index (none under this strategy, or not serving) lose their copies
        for name, u in (st.prefix or {}).items():
            copy = self.prefix.get(name)
            if u is not None:
                copy = copy if copy is not None else PrefixIndex.copy_of(u)
                copy.follow(u)
            if copy is not None:
                copies[name] = copy
        self.prefix = copies
        if any(m.seq <= st.acked for m in self.mine.values()):
            self.mine = {rid: m for rid, m in self.mine.items() if m.seq > st.acked}
        self.at = asked_at

    async def _refresh(self) -> None:
        asked_at = asyncio.get_running_loop().time()
        try:
            copies = {n: (c.epoch, c.version) for n, c in self.prefix.items()}
            call = self.controller.placement_state.remote(self.id, tuple(self.handles), copies)
            self.apply(await asyncio.wait_for(call, max(self.max_age_s, 5.0)), asked_at)
        except (ray.exceptions.RayError, TimeoutError):  # restarting: requests go to the controller meanwhile
            pass
        except Exception:
            log.exception("the gateway's placement views")
        finally:
            self._task = None

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
