"""Structured outputs checked in worker processes (cluster/serving/grammar_pool.py), with the gateway's own vLLM config
(tiny-llama's, SmolLM2's tokenizer): the event loop never compiles a grammar, a check past its time is refused and
its worker replaced, a bad grammar is vLLM's own 400, a grammar checked once is not checked again. No Ray."""

from __future__ import annotations

import asyncio
import time

import pytest
from cluster_harness import config

from cluster.serving.frontend import frontend
from cluster.serving.grammar_pool import GrammarBusy, GrammarPool, GrammarTooLong

pytestmark = pytest.mark.timeout(300)


def bomb(properties: int = 240) -> dict:
    """A schema xgrammar refuses (``multipleOf``) and guidance too (``patternProperties``), so vLLM's ``auto``
    backend checks it with outlines, whose regex for it takes seconds to parse (its time grows with the square of
    the properties)."""
    props = {f"field_{i}": {"type": "string"} for i in range(properties)}
    props["count"] = {"type": "integer", "multipleOf": 2}
    return {"type": "object", "properties": props, "patternProperties": {"^x_": {"type": "string"}}}


def request(schema: dict):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    prompt = {"type": "token", "prompt_token_ids": [1, 2, 3]}
    return prompt, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))


async def lag_while(coro) -> tuple[object, float]:
    """``coro``'s outcome (its result or exception) and the event loop's longest stall while it ran."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    worst, last = 0.0, loop.time()
    while not task.done():
        await asyncio.sleep(0.01)
        now = loop.time()
        worst, last = max(worst, now - last - 0.01), now
    try:
        return task.result(), worst
    except Exception as e:  # noqa: BLE001 - returned for the test to judge
        return e, worst


@pytest.fixture(scope="module")
def vllm_config():
    return frontend(config("grammar", model="tiny-llama", engine={"kind": "fake", "max_model_len": 512})).vllm_config


def test_the_event_loop_never_compiles_a_grammar_and_a_slow_one_is_refused(vllm_config):
    from vllm.exceptions import VLLMValidationError

    async def main():
        pool = GrammarPool(vllm_config, workers=1, timeout_s=1.0, max_pending=0)
        try:
            small = {"type": "object", "properties": {"a": {"type": "string"}}}
            await pool.check("warm", *request(small))  # the worker's start is waited for apart
            first = pool._all[0]
            outcome, stall = await lag_while(pool.check("bomb", *request(bomb())))
            assert isinstance(outcome, GrammarTooLong) and "grammar_timeout_s" in str(outcome), outcome
            assert stall < 0.25, f"the event loop stalled {stall:.2f} s while a grammar was checked"
            assert first not in pool._all and not first.proc.is_alive()  # killed and replaced
            # the replacement serves; a bad grammar is vLLM's own refusal
            bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
            outcome, _ = await lag_while(pool.check("bad", *request(bad)))
            assert isinstance(outcome, VLLMValidationError), outcome
            # a grammar that passed is not checked again: no worker is asked (its pipe is closed to prove it)
            worker = pool._all[0]
            worker.conn.close()
            await pool.check("again", *request(small))
            # max_pending 0: while the one worker is out, another grammar is refused at once
            pool._all.clear()
            pool._idle = asyncio.Queue()
            with pytest.raises(GrammarBusy):
                await pool.check("busy", *request({"type": "string"}))
        finally:
            pool.close()

    asyncio.run(main())


def test_negative_control_the_same_check_on_the_event_loop_stalls_it(vllm_config):
    """What the pool avoids: vLLM's input processor checking the same schema in the event loop's thread holds it
    for seconds (the issue's 3 s freeze), so the stall bound above can fail."""
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(vllm_config, renderer_from_config(vllm_config))

    async def main():
        async def inline():
            await asyncio.sleep(0.05)
            t = time.monotonic()
            processor.process_inputs("inline", *request(bomb(160)), supported_tasks=("generate",))
            return time.monotonic() - t

        return await lag_while(inline())

    took, stall = asyncio.run(main())
    assert stall > 1.0 and took > 1.0, (took, stall)
