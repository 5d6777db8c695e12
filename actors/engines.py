"""The engines a replica can host, behind one small interface, chosen by name from a registry.

``vllm`` is the real one: a vToken-enabled ``AsyncLLM``. ``fake`` is an in-process stand-in with the
same block accounting (a pool of blocks, requests that hold ``ceil(tokens / block_size)`` of them),
so controller, placement and gateway tests run in seconds without vLLM (Ray Serve LLM style).

Outputs cross to the gateway as ``Chunk``s (actors/wire.py: vLLM's RequestOutput, the fields the gateway's serving
layer reads). Errors cross as data, never as exceptions with tracebacks: a request the engine refuses is a
``Chunk`` with ``code`` ``invalid_argument`` and the engine's one-line reason. An engine that can serve no more
(its process died) raises ``EngineDead``; the replica turns that into ``unavailable`` and restarts the engine.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from actors.prefix_tracker import PrefixTracker
from actors.report import plain_pool, prefix_capacity
from actors.wire import ABORTED, Chunk, GenerateSpec, Position, Seq, from_output, one_line  # noqa: F401 (re-exported)
from vtoken.pool_report import PoolReport
from vtoken.prefix_hash import prefix_hashes

# What the client hears of a request the engine ended with finish reason "error" (vLLM's server: a 500).
ENDED_WITH_ERROR = (
    "the engine could not serve this request (vToken failed while deciding for it; the replica's log says why); "
    "other requests were not affected"
)


class EngineDead(RuntimeError):
    """The engine can serve no more requests (its process died); only a new engine helps."""


class Engine(ABC):
    """Hosts requests. Invariant: once ``generate`` returns or is cancelled, or ``abort`` is called,
    the request holds no blocks (``pool_report().free_blocks`` goes back up at once). ``admitted`` in a
    report lists (sorted) the ids of the requests whose blocks that same report counts as held.
    Once ``errored``, ``generate`` and ``pool_report`` raise ``EngineDead``.
    ``prefix``: what its prefix cache holds (actors/prefix_tracker.py), None when the engine cannot tell."""

    prefix: PrefixTracker | None = None

    @abstractmethod
    def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def pool_report(self) -> PoolReport: ...

    @property
    def errored(self) -> bool:
        return False

    async def stats(self) -> dict[str, Any]:
        """What the engine can tell about the requests it served (tests, debugging); may be empty."""
        return {}

    def prefix_counters(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache and found there since the engine started (vLLM's
        ``prefix_cache_queries`` and ``prefix_cache_hits``)."""
        return 0, 0

    async def shutdown(self) -> None:
        return None


class FakeEngine(Engine):
    """Emits one token per ``token_delay_s``; a request waits until its peak blocks
    (prompt + max_tokens) are free, then holds them to the end. Token i of a request is ``i % 97``.
    ``start_s`` makes construction take that long (a real engine's start); ``die()`` makes it fail like a
    vLLM engine whose EngineCore process was killed.
    Its prefix cache: the full blocks of the prompts it admitted, the least recently used dropped beyond
    ``total_blocks``, announced to its PrefixTracker as vLLM's KV events would be (the fake's block hashes are the
    chain's own); an admitted prompt's leading blocks found there count as hits."""

    def __init__(
        self,
        total_blocks: int = 64,
        block_size: int = 32,
        token_delay_s: float = 0.01,
        reclaim_fraction: float = 0.0,
        start_s: float = 0.0,
    ):
        time.sleep(start_s)  # the replica builds engines in a thread
        self.total_blocks, self.block_size, self.delay = total_blocks, block_size, token_delay_s
        self.reclaim_fraction = reclaim_fraction
        self.held: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.to_go: dict[str, int] = {}  # tokens each admitted request has still to generate
        self.waiting: set[str] = set()
        self.aborted: set[str] = set()
        # The sampling each request arrived with, last ones first out: tests check what reached the engine
        # (a real engine's record of the same is vtoken_stats' finished requests).
        self.seen: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.dead = False
        self._cv = asyncio.Condition()
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()  # block hashes, oldest first
        self.prefix = PrefixTracker(block_size, prefix_capacity(total_blocks))
        self.queries = self.hits = 0

    def prefix_counters(self) -> tuple[int, int]:
        return self.queries, self.hits

    def _cache_prompt(self, tokens: list[int]) -> None:
        """A prompt admitted: its cached leading blocks are hits, then all its full blocks are cached."""
        hashes = prefix_hashes(tokens, self.block_size)
        hit = next((i for i, h in enumerate(hashes) if h not in self.cache), len(hashes))
        self.queries += len(tokens)
        self.hits += hit * self.block_size
        for h in hashes:
            self.cache.pop(h, None)
            self.cache[h] = None
        self.prefix.stored(hashes, None, tokens[: len(hashes) * self.block_size], self.block_size)
        gone = []
        while len(self.cache) > self.total_blocks:
            gone.append(self.cache.popitem(last=False)[0])
        self.prefix.removed(gone)

    def _free(self) -> int:
        return self.total_blocks - sum(self.held.values())

    @property
    def errored(self) -> bool:
        return self.dead

    def die(self) -> None:
        """Testing: from now on fail as a dead vLLM engine does (every call raises EngineDead)."""
        self.dead = True

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        if self.dead:
            raise EngineDead("fake engine is dead")
        self.seen.append({"request_id": spec.request_id, **spec.sampling})
        sampling = spec.sampling
        max_tokens, n = spec.max_tokens, spec.n
        top, prompt_top = sampling.get("logprobs"), sampling.get("prompt_logprobs")
        need = n * math.ceil((len(spec.prompt_token_ids) + max_tokens) / self.block_size)
        if need > self.total_blocks:
            yield Chunk.failed("invalid_argument", f"request needs {need} blocks, the pool has {self.total_blocks}")
            return
        rid = spec.request_id
        try:
            async with self._cv:
                self.waiting.add(rid)
                await self._cv.wait_for(lambda: self._free() >= need or rid in self.aborted)
                self.waiting.discard(rid)
                admitted = rid not in self.aborted
                if admitted:
                    self.held[rid], self.live[rid] = need, n * len(spec.prompt_token_ids)
                    self.to_go[rid] = n * max_tokens
                    self._cache_prompt(list(spec.prompt_token_ids))
            if not admitted:
                yield ABORTED
                return
            prompt_lps = None
            if prompt_top is not None:
                prompt_lps = (None,) + tuple(fake_position(t, prompt_top) for t in spec.prompt_token_ids[1:])
            for i in range(max_tokens):
                await asyncio.sleep(self.delay)
                if self.dead:
                    raise EngineDead("fake engine died")
                if rid in self.aborted:
                    await self._release(rid)  # the blocks are free before the caller hears of the abort
                    yield ABORTED
                    return
                self.live[rid] += n
                self.to_go[rid] = n * (max_tokens - i - 1)
                last = i == max_tokens - 1
                t = i % 97
                lps = None if top is None else (fake_position(t, top),)
                seqs = tuple(Seq(j, f" t{t}", (t,), lps, None, "length" if last else None) for j in range(n))
                yield Chunk(seqs, last, prompt_lps if i == 0 else None, 0 if i == 0 else None)
        finally:
            await self._release(rid)

    async def _release(self, rid: str) -> None:
        async with self._cv:
            self.waiting.discard(rid)
            self.aborted.discard(rid)
            self.held.pop(rid, 0)
            self.live.pop(rid, None)
            self.to_go.pop(rid, None)
            self._cv.notify_all()

    async def abort(self, request_id: str) -> None:
        async with self._cv:
            if request_id in self.held or request_id in self.waiting:
                self.aborted.add(request_id)
            self._cv.notify_all()

    async def stats(self) -> dict[str, Any]:
        return {"requests": list(self.seen)}

    async def pool_report(self) -> PoolReport:
        if self.dead:
            raise EngineDead("fake engine is dead")
        held = sum(self.held.values())
        return plain_pool(self.total_blocks - held, self.total_blocks, len(self.held), len(self.waiting),
                          sum(self.live.values()), self.held, self.block_size, sum(self.to_go.values()),
                          reclaimed=int(held * self.reclaim_fraction))  # fmt: skip


def fake_position(token_id: int, top: int) -> Position:
    """The fake engine's "log-probabilities" at one position, fixed values in vLLM's shape: the token itself (the most
    likely, rank 1) first, then the next ``top - 1`` by rank (vLLM's top ``top`` with the sampled token among them)."""
    alts = tuple((token_id + k, -0.5 - k, k + 1, f" t{token_id + k}") for k in range(1, top))
    return ((token_id, -0.5, 1, f" t{token_id}"), *alts)


class VLLMEngine(Engine):
    """A vToken-enabled ``AsyncLLM`` (vtoken.vllm_adapter.make_async_llm); prompts arrive as token ids.
    With prefix caching on (vLLM's default), its KV events feed ``prefix`` (vllm_adapter/kv_events.py)."""

    def __init__(self, model: str, vtoken: dict[str, Any], engine_args: dict[str, Any]):
        from pathlib import Path

        from vtoken.models import model_path
        from vtoken.vllm_adapter import VTokenConfig, make_async_llm
        from vtoken.vllm_adapter.engine import pool_blocks_async
        from vtoken.vllm_adapter.kv_events import KVEventSubscriber, events_config
        from vtoken.vllm_adapter.stock_pool import StockPool

        # A model name is resolved here, on the replica's node, where the model folder lives.
        folder = model if Path(model).is_dir() else str(model_path(model))
        self.vtoken = VTokenConfig(**vtoken)
        self.block_size = int(engine_args.get("block_size") or 0)
        self.stock = StockPool()  # vLLM's own statistics of its pool: the report of a stock engine (vToken off)
        self.events, self._endpoint = None, ""
        caching = engine_args.get("enable_prefix_caching") is not False
        args, where = events_config(engine_args) if caching else (engine_args, None)
        self.llm = make_async_llm(folder, self.vtoken, stat_loggers=[self.stock.logger_factory()], **args)
        self.live: dict[str, _Live] = {}  # the requests in generate()
        if where is not None:
            cache = self.llm.vllm_config.cache_config
            self.prefix = PrefixTracker(cache.block_size, prefix_capacity(pool_blocks_async(self.llm)))
            self.events = KVEventSubscriber(*where, self.prefix)
            self._endpoint = where[0] if args is not engine_args else ""  # ours to remove at shutdown

    def prefix_counters(self) -> tuple[int, int]:
        return self.stock.prefix_queries, self.stock.prefix_hits

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        n = spec.n
        live = self.live[spec.request_id] = _Live(n * len(spec.prompt_token_ids), n * spec.max_tokens)
        try:
            async for chunk in self._generate(spec):
                live.started, live.generated = True, live.generated + chunk.tokens
                yield chunk
        finally:
            self.live.pop(spec.request_id, None)

    async def _generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        started = False
        try:
            params = SamplingParams.from_optional(**spec.sampling, output_kind=RequestOutputKind.DELTA)
            kwargs = dict(spec.engine_kwargs)
            prompt = TokensPrompt(prompt_token_ids=list(spec.prompt_token_ids))
            if kwargs.get("cache_salt"):  # the prompt's, as vLLM's renderer put it there (wire.GenerateSpec)
                prompt["cache_salt"] = kwargs.pop("cache_salt")
            # AsyncLLM.generate aborts the request itself when this generator is closed or cancelled.
            async for out in self.llm.generate(prompt, params, spec.request_id, **kwargs):
                started = True
                if any(c.finish_reason == "error" for c in out.outputs):  # the engine ended this request alone
                    # (vToken could not decide for it; the replica's log has why): an error for this client, and
                    # the engine serves on
                    yield Chunk.failed("internal", ENDED_WITH_ERROR)
                    return
                yield from_output(out)
                if out.finished:
                    return
        except EngineDeadError as e:
            raise EngineDead("vLLM's EngineCore died") from e
        except VLLMClientError as e:  # VLLMValidationError and friends: the request as sent
            yield Chunk.failed("invalid_argument", str(e))
        except (ValueError, TypeError) as e:
            if started:  # not a judgement on the request: the replica reports it as internal
                raise
            yield Chunk.failed("invalid_argument", str(e))  # vLLM's older checks (lengths, sampling values)

    async def abort(self, request_id: str) -> None:
        if not self.errored:
            await self.llm.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        """vToken's engine statistics (vtoken_stats_async): per finished request its policy, budget, blocks."""
        if not self.vtoken.enabled or self.errored:
            return {}
        from vtoken.vllm_adapter import vtoken_stats_async

        return await vtoken_stats_async(self.llm)

    async def pool_report(self) -> PoolReport:
        from vllm.v1.engine.exceptions import EngineDeadError

        from vtoken.vllm_adapter.engine import pool_report_async

        if self.errored:
            raise EngineDead("vLLM's EngineCore is not running")
        if not self.vtoken.enabled:
            return self._stock_report()
        try:
            return await pool_report_async(self.llm)
        except EngineDeadError as e:
            raise EngineDead("vLLM's EngineCore died") from e

    async def shutdown(self) -> None:
        self.llm.shutdown()
        if self.events is not None:
            from vtoken.vllm_adapter.kv_events import remove_endpoint

            self.events.close()
            if self._endpoint:
                remove_endpoint(self._endpoint)

    def _stock_report(self) -> PoolReport:
        """Stock vLLM (vToken off): its pool from vLLM's own scheduler statistics (vllm_adapter/stock_pool.py).
        ``admitted`` lists the requests that have streamed a first chunk: their blocks are allocated in a step
        whose statistics have arrived, so the controller may drop their promises; a request still before its
        first chunk keeps its promise (counted twice at worst, never missed). Nothing is evicted or reclaimed."""
        from vtoken.vllm_adapter.engine import pool_blocks_async

        total = pool_blocks_async(self.llm)
        # With no request of ours in it, the engine holds nothing: vLLM sends statistics only when it steps, so
        # after an abort (a client gone, a drain) that freed the last blocks its last figures would stay stale.
        idle = not self.live
        free = total if idle else self.stock.free_blocks(total)
        started = [(rid, r) for rid, r in self.live.items() if r.started]
        to_go = sum((0 if r.started else r.prompt) + max(r.max_tokens - r.generated, 0) for r in self.live.values())
        return plain_pool(free, total, 0 if idle else self.stock.running, 0 if idle else self.stock.waiting,
                          sum(r.prompt + r.generated for _, r in started), [rid for rid, _ in started],
                          self.block_size, to_go, usage=0.0 if idle else self.stock.usage)  # fmt: skip


@dataclass
class _Live:
    """A request in a replica's generate(): its prompt, its max_tokens, what it has streamed so far."""

    prompt: int
    max_tokens: int
    generated: int = 0
    started: bool = False


ENGINES: dict[str, Callable[..., Engine]] = {"fake": FakeEngine, "vllm": VLLMEngine}


@dataclass(frozen=True)
class EngineFactory:
    """A picklable recipe: Ray ships it to the replica, which calls it (in a thread) to build its engine."""

    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ENGINES:
            raise ValueError(f"unknown engine {self.kind!r}; known: {', '.join(sorted(ENGINES))}")

    def __call__(self) -> Engine:
        return ENGINES[self.kind](**self.kwargs)
