"""Rendering and tokenizing off the gateway's event loop, bounded in size and time.

Both doors parse a request (vLLM's protocol model, the chat template, the tokenizer) before it is placed. On the
event loop, that work made every other client wait its turn (~35 ms for a 64K-character prompt) and one request
whose rendering never ended froze the whole service: ``/health``, every chat, the gRPC door and Ctrl-C. Here it
runs in a few worker threads, as vLLM's own server tokenizes in a thread pool, so the loop only awaits it:

    size   gateway.max_request_bytes and gateway.max_prompt_chars bound what is parsed (checked before any work)
    time   gateway.parse_timeout_s bounds the wait: a parse that runs longer is a 413 (RESOURCE_EXHAUSTED over
           gRPC) for its request; one that never started because every worker was busy is a 503 (UNAVAILABLE)
    queue  gateway.parse_workers threads; at most gateway.max_parse_pending requests wait for one (beyond, 503)

The threads are daemon threads: a parse cannot be interrupted, but it can never keep the process from stopping,
so Ctrl-C stops the service in seconds whatever a request is doing. With the model's own template (issue 46:
requests cannot smuggle one in) the work is linear in the bounded size, so a timed-out parse ends by itself soon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("vtoken.parsing")
T = TypeVar("T")


class ParseTooLong(Exception):
    """The request's parse ran past ``timeout_s`` (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""


class ParseBusy(Exception):
    """Every parse worker was busy for ``timeout_s``, or too many requests waited (HTTP 503, gRPC UNAVAILABLE)."""


class _Job:
    __slots__ = ("fn", "args", "loop", "future", "started", "abandoned")

    def __init__(self, fn, args, loop, future):
        self.fn, self.args, self.loop, self.future = fn, args, loop, future
        self.started = False  # a worker took it (under the pool's lock)
        self.abandoned = False  # its request gave up before a worker took it (under the pool's lock)


class ParsePool:
    """``await pool.run(fn, *args)``: ``fn(*args)`` in a worker thread; its result, or its exception re-raised.
    Invariant: the event loop never runs ``fn``; at most ``workers`` parses run at once and ``max_pending`` wait."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, max_pending: int = 256, name: str = "parse"):
        if workers < 1 or timeout_s <= 0 or max_pending < 0:
            raise ValueError("ParsePool: workers >= 1, timeout_s > 0 and max_pending >= 0")
        self.timeout_s, self.max_pending = timeout_s, max_pending
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # jobs queued that no worker took yet
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]  # fmt: skip
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        with self._lock:
            if self._waiting >= self.max_pending:
                raise ParseBusy(
                    f"{self._waiting} requests wait for a parse worker (gateway.max_parse_pending); retry"
                )  # fmt: skip
            self._waiting += 1
        self._jobs.put(job)
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), self.timeout_s)
        except TimeoutError:
            with self._lock:
                started = job.started
                if not started:
                    job.abandoned = True
                    self._waiting -= 1
            if not started:
                raise ParseBusy(
                    f"no parse worker was free for {self.timeout_s:g} s (gateway.parse_timeout_s); retry"
                ) from None
            log.warning("a request's parse ran past %.3g s; refused (its worker finishes it and moves on)",
                        self.timeout_s)  # fmt: skip
            raise ParseTooLong(
                f"rendering and tokenizing this request took over {self.timeout_s:g} s (gateway.parse_timeout_s); "
                "send a shorter prompt"
            ) from None
        except asyncio.CancelledError:  # the client went away: a job not taken yet is never run
            with self._lock:
                if not job.started:
                    job.abandoned = True
                    self._waiting -= 1
            raise

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.abandoned:
                    continue
                job.started = True
                self._waiting -= 1
            try:
                result, error = job.fn(*job.args), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting request, raised there
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop is closed: the service is stopping
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)

    def close(self) -> None:
        """Let the workers end once their current job is done (they are daemon threads: nothing waits for them)."""
        for _ in self._threads:
            self._jobs.put(None)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled: its request timed out or went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
