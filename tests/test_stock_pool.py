"""A stock replica (vToken off, the baseline users compare against) reports its pool: free and total blocks from
vLLM's own scheduler statistics (vtoken/vllm_adapter/stock_pool.py), so `vtoken status`, /metrics and capacity
placement see the baseline's pool too. Before, a stock replica reported 0 free and 0 total blocks."""

from __future__ import annotations

import asyncio
import gc

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from actors.engines import GenerateSpec, VLLMEngine  # noqa: E402

ARGS = {"dtype": "float32", "block_size": 32, "max_model_len": 1024, "enforce_eager": True, "seed": 0,
        "kv_cache_memory_bytes": 16 << 20}  # fmt: skip


def test_a_stock_engine_reports_its_pool_while_a_request_runs_and_after():
    async def main():
        engine = VLLMEngine("tiny-llama", {"mode": "off"}, ARGS)
        try:
            idle = await engine.pool_report()
            spec = GenerateSpec("r1", list(range(100, 400)), {"max_tokens": 64, "ignore_eos": True}, 64)
            seen = []
            async for chunk in engine.generate(spec):
                if len(seen) == 8:
                    seen.append(await engine.pool_report())
                seen.append(chunk)
            busy = seen[8]
            await asyncio.sleep(0.2)
            after = await engine.pool_report()
            return idle, busy, after
        finally:
            await engine.shutdown()
            engine.llm = None  # AsyncLLM's __del__ now, not at interpreter exit (where it trips over vLLM's globals)
            gc.collect()

    idle, busy, after = asyncio.run(main())
    assert idle.total_blocks > 0 and idle.free_blocks == idle.total_blocks, idle
    # 300 prompt tokens and a few outputs in 32-token blocks: 10 blocks held, all counted and listed
    assert busy.total_blocks == idle.total_blocks
    assert busy.free_blocks == busy.total_blocks - 10 and busy.retained_blocks == 10, busy
    assert busy.running == 1 and busy.admitted == ("r1",) and busy.live_tokens >= 300
    assert busy.blocks_reclaimed == 0 and 0 < busy.tokens_to_go <= 64
    assert after.free_blocks == after.total_blocks and after.admitted == () and after.running == 0, after


def test_a_stock_engine_whose_last_request_was_aborted_reports_every_block_free():
    """vLLM sends statistics only when it steps: after an abort freed the last blocks, its figures stayed those of
    the last step (a drained stock replica reported 20 of 44 blocks free)."""

    async def main():
        engine = VLLMEngine("tiny-llama", {"mode": "off"}, ARGS)
        try:
            spec = GenerateSpec("r1", list(range(100, 400)), {"max_tokens": 200, "ignore_eos": True}, 200)
            gen = engine.generate(spec)
            for _ in range(5):
                await anext(gen)
            busy = await engine.pool_report()
            await engine.abort("r1")
            await gen.aclose()
            await asyncio.sleep(0.5)
            return busy, await engine.pool_report()
        finally:
            await engine.shutdown()
            engine.llm = None  # AsyncLLM's __del__ now, not at interpreter exit (where it trips over vLLM's globals)
            gc.collect()

    busy, after = asyncio.run(main())
    assert busy.free_blocks < busy.total_blocks
    assert after.free_blocks == after.total_blocks and after.running == 0 and after.admitted == ()
