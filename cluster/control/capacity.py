"""The capacity stream for routers in front of vToken (``WatchCapacity``): each replica's free, total and
reclaimed blocks, promised blocks, running and waiting requests, pushed when they change.

One poller per gateway, running only while someone watches, reads the controller's snapshot every ``poll_s``
(replicas report a change within ~0.2 s, so an update reaches a router within about half a second) and bumps
a version when the routing-relevant figures changed (not merely the report's time). Each watcher sends the
latest figures, then waits ``min_interval_s`` before the next: changes in between coalesce into one update.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from cluster.control.snapshot import ClusterSnapshot

log = logging.getLogger("vtoken.gateway")
MIN_INTERVAL_S = 0.25  # at most four updates a second per watcher


class ReplicaCapacity(NamedTuple):
    """The fields of the proto's ReplicaCapacity, in its order."""

    name: str
    state: str
    free_blocks: int
    total_blocks: int
    blocks_reclaimed: int
    promised_blocks: int
    running: int
    waiting: int
    block_size: int
    report_time: float

    def key(self) -> tuple:
        """What a router places by: everything but the report's time."""
        return self[:-1]


def capacity(snap: ClusterSnapshot) -> tuple[ReplicaCapacity, ...]:
    return tuple(
        ReplicaCapacity(
            r.name,
            str(r.state),  # the proto's string
            p.free_blocks,
            p.total_blocks,
            p.blocks_reclaimed,
            r.promised_blocks,
            p.running,
            p.waiting,
            p.block_size,
            r.report.time,
        )
        for r in snap.replicas
        for p in (r.report.pool,)
    )


class CapacityFeed:
    """Invariants: the poller runs exactly while ``watchers > 0``; ``version`` grows by one each time the
    routing-relevant figures change; after ``close()`` every watcher returns and no new one starts."""

    def __init__(self, controller: Any, poll_s: float = 0.1):
        self.controller, self.poll_s = controller, poll_s
        self.rows: tuple[ReplicaCapacity, ...] = ()
        self.version = 0
        self.watchers = 0
        self.closed = False
        self._changed = asyncio.Condition()
        self._poller: asyncio.Task | None = None

    async def watch(self, min_interval_s: float = MIN_INTERVAL_S) -> AsyncIterator[tuple[ReplicaCapacity, ...]]:
        """The current figures at once, then the latest after each change, at most one per ``min_interval_s``."""
        interval = max(min_interval_s, MIN_INTERVAL_S)
        self.watchers += 1
        seen = 0  # the poller runs: its figures are fresh, send them at once
        if self._poller is None or self._poller.done():
            seen = self.version  # figures from before the poller stopped are stale: wait for its first read
            self._poller = asyncio.ensure_future(self._poll())
        try:
            while not self.closed:
                async with self._changed:
                    await self._changed.wait_for(lambda seen=seen: self.version > seen or self.closed)
                if self.closed:
                    return
                seen = self.version
                yield self.rows
                await asyncio.sleep(interval)
        finally:
            self.watchers -= 1
            if not self.watchers and self._poller is not None:
                self._poller.cancel()
                self._poller = None

    async def close(self) -> None:
        self.closed = True
        async with self._changed:
            self._changed.notify_all()
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        failing, first = False, True
        while True:
            try:
                rows = capacity(await self.controller.snapshot.remote())
                if first or [r.key() for r in rows] != [r.key() for r in self.rows]:
                    async with self._changed:
                        self.rows = rows
                        self.version += 1
                        self._changed.notify_all()
                failing, first = False, False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a slow or restarting controller: keep the last figures, try again
                if not failing:
                    log.warning("capacity stream: cannot read the controller: %s", e)
                    failing = True
            await asyncio.sleep(self.poll_s)
