"""Structured outputs (a JSON schema, a regex, a grammar, choices) checked by vLLM's own input processor in worker
processes, off the gateway's event loop and out of its heap, each check bounded in time.

Why processes, not threads: checking a grammar is vLLM's ``InputProcessor.process_inputs`` (``SamplingParams.verify``
-> ``_validate_structured_outputs``), and for a schema xgrammar refuses, the ``auto`` backend falls back to outlines,
which builds a regex from the schema and parses it with Python's own regex parser: a 4.7 KB schema of 160 optional
properties became a 950 KB regex and 2-3 s of parsing, growing with the square of the properties. In a thread the
parse still stopped the event loop for up to 0.56 s at a time (measured: the garbage collector walking the parse's
millions of objects holds the GIL), and a thread cannot be stopped. A worker process has its own heap and its own
GIL, and one past ``gateway.grammar_timeout_s`` is killed and replaced: the request gets a 413 naming its field.

    workers   gateway.grammar_workers processes, each built as vLLM's render server builds its config (the
              gateway's own ``VllmConfig``, pickled: ~13 KB), started with the gateway
    time      gateway.grammar_timeout_s per check, from the moment a worker takes it (a worker still starting is
              waited for apart: the first requests after a start are not refused for it)
    queue     at most gateway.max_grammar_pending requests wait for a worker (beyond, 503)
    cache     a grammar checked once is not checked again (the last CACHE grammars, by their text)

The rest of a request (its prompt, its sampling) is checked on the event loop as before, without the grammar: that
part is microseconds. Invariant: the event loop never compiles a grammar.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import pickle
from collections import OrderedDict
from typing import Any

log = logging.getLogger("vtoken.grammar")
CACHE = 256  # grammars known good: a client that sends the same schema with every request pays once
START_TIMEOUT_S = 120.0  # a worker builds vLLM's config and tokenizer (~6 s on 2 cores)


class GrammarTooLong(Exception):
    """The check ran past ``timeout_s``: the request's fault (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""


class GrammarBusy(Exception):
    """No worker was free in time, or too many requests wait for one (HTTP 503, gRPC UNAVAILABLE)."""


def grammar_key(params: Any) -> str | None:
    """The request's structured output as text (the cache's key), or None when it has none."""
    so = getattr(params, "structured_outputs", None)
    if so is None:
        return None
    fields = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
              "disable_additional_properties", "whitespace_pattern")  # fmt: skip
    return json.dumps({f: getattr(so, f, None) for f in fields}, sort_keys=True, default=str)


class _Worker:
    """One process and its end of a pipe. ``ready`` once it has built vLLM's input processor."""

    def __init__(self, ctx: Any, config: bytes):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, config), name="vtoken-grammar", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    async def recv(self, timeout_s: float) -> Any:
        """The worker's next message; TimeoutError past ``timeout_s``; EOFError if the worker died."""
        loop = asyncio.get_running_loop()
        if not self.conn.poll():
            arrived = loop.create_future()
            fd = self.conn.fileno()
            loop.add_reader(fd, lambda: arrived.done() or arrived.set_result(None))
            try:
                await asyncio.wait_for(arrived, timeout_s)
            finally:
                loop.remove_reader(fd)
        return self.conn.recv()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


class GrammarPool:
    """``await pool.check(request_id, prompt, params)``: vLLM's ``process_inputs`` on the request in a worker
    process; returns when it passes, raises what vLLM raised (``VLLMValidationError``, ``ValueError``) or
    GrammarTooLong / GrammarBusy. Invariant: at most ``workers`` checks run at once and ``max_pending`` wait; a
    worker past its time is killed, so no check outlives its request by more than the replacement's start."""

    def __init__(self, vllm_config: Any, workers: int = 1, timeout_s: float = 5.0, max_pending: int = 64):
        if workers < 1 or timeout_s <= 0 or max_pending < 0:
            raise ValueError("GrammarPool: workers >= 1, timeout_s > 0 and max_pending >= 0")
        self.timeout_s, self.max_pending = timeout_s, max_pending
        self._config = pickle.dumps(vllm_config)
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process that runs Ray and threads
        self._idle: asyncio.Queue[_Worker] | None = None  # made in the event loop that uses the pool
        self._workers = workers
        self._all: list[_Worker] = []
        self._waiting = 0
        self._known: OrderedDict[str, None] = OrderedDict()

    def start(self) -> None:
        """Start the workers (they build themselves in the background: a check waits for one that is not ready)."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._workers):
                self._add()

    def _add(self) -> None:
        w = _Worker(self._ctx, self._config)
        self._all.append(w)
        self._idle.put_nowait(w)

    @property
    def waiting(self) -> int:
        return self._waiting

    async def check(self, request_id: str, prompt: Any, params: Any) -> None:
        key = grammar_key(params)
        if key is None or key in self._known:
            if key is not None:
                self._known.move_to_end(key)
            return
        self.start()
        if self._idle.empty() and self._waiting >= self.max_pending:
            raise GrammarBusy(f"{self._waiting} requests wait for a grammar worker (gateway.max_grammar_pending)")
        self._waiting += 1
        try:
            worker = await asyncio.wait_for(self._idle.get(), self.timeout_s)
        except TimeoutError:
            raise GrammarBusy(
                f"no grammar worker was free for {self.timeout_s:g} s (gateway.grammar_timeout_s); retry"
            ) from None
        finally:
            self._waiting -= 1
        healthy = False
        try:
            if not worker.ready:
                await worker.recv(START_TIMEOUT_S)  # its "ready"
                worker.ready = True
            worker.conn.send((request_id, prompt, params))
            try:
                outcome, error = await worker.recv(self.timeout_s)
            except TimeoutError:
                log.warning("a request's structured output took over %.3g s to check; refused, worker replaced",
                            self.timeout_s)  # fmt: skip
                raise GrammarTooLong(
                    f"checking this request's structured output took over {self.timeout_s:g} s "
                    "(gateway.grammar_timeout_s); send a smaller schema or grammar"
                ) from None
            healthy = True
        finally:
            if healthy:
                self._idle.put_nowait(worker)
            else:  # timed out, died, or its request went away mid-check: the worker's state is unknown
                worker.kill()
                self._all.remove(worker)
                self._add()
        if outcome == "ok":
            self._known[key] = None
            while len(self._known) > CACHE:
                self._known.popitem(last=False)
            return
        raise _rebuilt(*error)

    def close(self) -> None:
        for w in self._all:
            w.kill()
        self._all.clear()


def _rebuilt(kind: str, message: str, parameter: str | None) -> Exception:
    """The worker's exception as the gateway raises it (vLLM's exceptions take keywords pickle does not carry)."""
    from vllm.exceptions import VLLMValidationError

    if kind == "VLLMValidationError":
        return VLLMValidationError(message, parameter=parameter)
    if kind in ("ValueError", "TypeError", "OverflowError"):
        return {"ValueError": ValueError, "TypeError": TypeError, "OverflowError": OverflowError}[kind](message)
    return RuntimeError(f"{kind}: {message}")


def _serve(conn: Any, config: bytes) -> None:  # pragma: no cover - runs in the worker process
    """A worker: vLLM's input processor built once, then one check per message until the pipe closes."""
    import logging as _logging

    _logging.disable(_logging.WARNING)  # vLLM's start-up chatter belongs to the gateway's log once, not per worker
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    vllm_config = pickle.loads(config)
    processor = InputProcessor(vllm_config, renderer_from_config(vllm_config))
    conn.send("ready")
    while True:
        try:
            request_id, prompt, params = conn.recv()
        except (EOFError, OSError):
            return
        try:
            processor.process_inputs(request_id, prompt, params, supported_tasks=("generate",))
            conn.send(("ok", None))
        except Exception as e:  # noqa: BLE001 - the request's fault, handed back by name
            text = str(e.args[0]) if e.args else str(e)  # vLLM's __str__ appends the parameter, carried apart
            conn.send(("error", (type(e).__name__, text, getattr(e, "parameter", None))))
