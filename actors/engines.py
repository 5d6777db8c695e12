"""The engines a replica can host, behind one small interface, chosen by name from a registry.

``vllm`` is the real one: a vToken-enabled ``AsyncLLM``. ``fake`` is an in-process stand-in with the
same block accounting (a pool of blocks, requests that hold ``ceil(tokens / block_size)`` of them),
so controller, placement and gateway tests run in seconds without vLLM (Ray Serve LLM style).
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# Figures a replica reports; engines fill what they know, the rest stay 0.
REPORT_KEYS = (
    "free_blocks",
    "total_blocks",
    "kv_cache_usage",
    "running",
    "waiting",
    "live_tokens",
    "blocks_reclaimed",
    "blocks_freed",
    "retained_blocks",
)


@dataclass(frozen=True)
class GenerateSpec:
    """One request as it crosses from the gateway to a replica: token ids in, sampling as a plain dict
    of ``vllm.SamplingParams`` fields (temperature, top_p, top_k, max_tokens, seed, stop, ignore_eos)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)


class Chunk(NamedTuple):
    """A streamed delta; ``error`` is set (and nothing else) when the engine refused the request."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str = ""
    error: str = ""


# What vLLM's AsyncLLM yields last for a request aborted by ``AsyncLLM.abort`` (the fake does the same).
ABORTED = Chunk(finished=True, finish_reason="abort")


class Engine(ABC):
    """Hosts requests. Invariant: once ``generate`` returns or is cancelled, or ``abort`` is called,
    the request holds no blocks (``stats()['free_blocks']`` goes back up at once). ``stats()['admitted']``
    lists (sorted) the caller's ids of the requests whose blocks that same snapshot counts as held."""

    @abstractmethod
    def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def stats(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None:
        return None


class FakeEngine(Engine):
    """Emits one token per ``token_delay_s``; a request waits until its peak blocks
    (prompt + max_tokens) are free, then holds them to the end. Token i of a request is ``i % 97``."""

    def __init__(
        self, total_blocks: int = 64, block_size: int = 32, token_delay_s: float = 0.01, reclaim_fraction: float = 0.0
    ):
        self.total_blocks, self.block_size, self.delay = total_blocks, block_size, token_delay_s
        self.reclaim_fraction = reclaim_fraction
        self.held: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.waiting: set[str] = set()
        self.aborted: set[str] = set()
        self.freed = 0
        self._cv = asyncio.Condition()

    def _free(self) -> int:
        return self.total_blocks - sum(self.held.values())

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        max_tokens = int(spec.sampling.get("max_tokens") or 16)
        need = math.ceil((len(spec.prompt_token_ids) + max_tokens) / self.block_size)
        if need > self.total_blocks:
            yield Chunk(error=f"request needs {need} blocks, the pool has {self.total_blocks}")
            return
        rid = spec.request_id
        try:
            async with self._cv:
                self.waiting.add(rid)
                await self._cv.wait_for(lambda: self._free() >= need or rid in self.aborted)
                self.waiting.discard(rid)
                admitted = rid not in self.aborted
                if admitted:
                    self.held[rid], self.live[rid] = need, len(spec.prompt_token_ids)
            if not admitted:
                yield ABORTED
                return
            for i in range(max_tokens):
                await asyncio.sleep(self.delay)
                if rid in self.aborted:
                    await self._release(rid)  # the blocks are free before the caller hears of the abort
                    yield ABORTED
                    return
                self.live[rid] += 1
                last = i == max_tokens - 1
                yield Chunk(f" t{i % 97}", (i % 97,), last, "length" if last else "")
        finally:
            await self._release(rid)

    async def _release(self, rid: str) -> None:
        async with self._cv:
            self.waiting.discard(rid)
            self.aborted.discard(rid)
            self.freed += self.held.pop(rid, 0)
            self.live.pop(rid, None)
            self._cv.notify_all()

    async def abort(self, request_id: str) -> None:
        async with self._cv:
            if request_id in self.held or request_id in self.waiting:
                self.aborted.add(request_id)
            self._cv.notify_all()

    async def stats(self) -> dict[str, Any]:
        held = sum(self.held.values())
        return {
            "free_blocks": self.total_blocks - held,
            "total_blocks": self.total_blocks,
            "kv_cache_usage": held / self.total_blocks,
            "running": len(self.held),
            "waiting": len(self.waiting),
            "live_tokens": sum(self.live.values()),
            "blocks_reclaimed": int(held * self.reclaim_fraction),
            "blocks_freed": self.freed,
            "retained_blocks": held,
            "admitted": sorted(self.held),
        }


class VLLMEngine(Engine):
    """A vToken-enabled ``AsyncLLM`` (vtoken.vllm_adapter.make_async_llm); prompts arrive as token ids."""

    def __init__(self, model: str, vtoken: dict[str, Any], engine_args: dict[str, Any]):
        from pathlib import Path

        from vtoken.models import model_path
        from vtoken.vllm_adapter import VTokenConfig, make_async_llm

        # A model name is resolved here, on the replica's node, where the model folder lives.
        folder = model if Path(model).is_dir() else str(model_path(model))
        self.vtoken = VTokenConfig(**vtoken)
        self.llm = make_async_llm(folder, self.vtoken, **engine_args)
        self.live: set[str] = set()  # the caller's ids of requests in generate()

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        self.live.add(spec.request_id)
        try:
            async for chunk in self._generate(spec):
                yield chunk
        finally:
            self.live.discard(spec.request_id)

    async def _generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        try:
            params = SamplingParams(**spec.sampling, output_kind=RequestOutputKind.DELTA)
            stream = self.llm.generate(
                TokensPrompt(prompt_token_ids=list(spec.prompt_token_ids)), params, spec.request_id
            )
            first = await anext(stream)
        except (ValueError, TypeError) as e:  # vLLM's own validation (length, sampling values)
            yield Chunk(error=str(e))
            return
        except StopAsyncIteration:
            return
        # AsyncLLM.generate aborts the request itself when this generator is closed or cancelled.
        out = first
        while True:
            c = out.outputs[0]
            yield Chunk(c.text, tuple(c.token_ids), out.finished, c.finish_reason or "")
            if out.finished:
                return
            try:
                out = await anext(stream)
            except StopAsyncIteration:
                return

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        from vtoken.vllm_adapter.engine import vtoken_stats_async

        if not self.vtoken.enabled:  # stock vLLM has no vtoken_stats utility: nothing to report
            return {k: 0 for k in REPORT_KEYS}
        s = await vtoken_stats_async(self.llm)
        # vLLM runs a request as "<caller's id>-<8 hex>"; its table exists once it holds blocks.
        admitted = {rid if rid in self.live else rid.rsplit("-", 1)[0] for rid in s.get("requests", {})}
        return {**{k: s.get(k, 0) for k in REPORT_KEYS}, "admitted": sorted(admitted)}

    async def shutdown(self) -> None:
        self.llm.shutdown()


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
