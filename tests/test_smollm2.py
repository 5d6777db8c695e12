"""End to end on the real model: SmolLM2-135M-Instruct, converted offline, served by vLLM on CPU."""

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.smollm]

from vtoken.models import model_path  # noqa: E402
from vtoken.texts import passages  # noqa: E402
from vtoken.vllm_adapter import VTokenConfig, open_llm, vtoken_stats  # noqa: E402


def chat(mode: str, prompts: list[str], max_tokens: int, **cfg):
    from vllm import SamplingParams

    with open_llm(
        str(model_path("smollm2-135m")),
        VTokenConfig(mode=mode, **{"evict": "always", **cfg}),
        dtype="float32",
        block_size=32,
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=256 << 20,
    ) as llm:
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            use_tqdm=False,
        )
        return [o.outputs[0].text for o in outs], (vtoken_stats(llm) if mode != "off" else None)


def test_smollm2_answers_and_vtoken_reclaims_blocks():
    (answer,), _ = chat("off", ["What is the capital of France?"], 20)
    assert "Paris" in answer

    doc = passages(1, 3000)[0]
    texts, stats = chat(
        "vtoken", [f"Summarise the following text in two sentences.\n\n{doc}"], 64, policy="h2o", budget=0.25
    )
    assert len(texts[0].split()) > 5
    (req,) = stats["finished_requests"]
    assert req["live_tokens"] < 0.3 * req["logical_tokens"]
    assert req["retained_blocks"] <= -(-req["live_tokens"] // 32) + 1 < req["naive_retained_blocks"]
    assert stats["free_blocks"] == stats["total_blocks"]
