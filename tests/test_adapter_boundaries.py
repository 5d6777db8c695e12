"""vLLM's private knowledge stays in vtoken/vllm_adapter/, importing it changes nothing, and the adapter's small
promises hold: an existing trace file is refused, the per-request policy cache is bounded. No engine starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vtoken.config import RequestConfigs  # noqa: E402
from vtoken.vllm_adapter import VTokenConfig, engine_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# vLLM internals that only the adapter may name: its request-id suffix, its engine's shutdown and core, its
# scheduler/worker class switches.
PRIVATE = re.compile(r"""rsplit\("-", 1\)\[0\]|rpartition\("-"\)|engine_core\.|llm_engine\.vllm_config""")


def test_vllm_private_knowledge_stays_in_the_adapter():
    found = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if (
            rel.parts[0] in (".venv", "build")
            or rel.parts[:2] == ("vtoken", "vllm_adapter")
            or rel == Path(__file__).relative_to(ROOT)
        ):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "vLLM internals outside vtoken/vllm_adapter/:\n" + "\n".join(found)


def test_importing_the_scheduler_patches_nothing_in_vllm():
    code = (
        "from vllm.v1.engine.core import EngineCore\n"
        "import vtoken.vllm_adapter.scheduler, vtoken.vllm_adapter.testing\n"
        "print(sorted(n for n in vars(EngineCore) if n.startswith('vtoken')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_engine_kwargs_leaves_the_environment_alone():
    before = dict(os.environ)
    engine_kwargs(VTokenConfig(mode="vtoken"), block_size=32)
    assert dict(os.environ) == before


def test_an_existing_trace_file_is_refused_unless_appending(tmp_path):
    trace = tmp_path / "trace.jsonl"
    engine_kwargs(VTokenConfig(trace_path=str(trace)))  # a new file is fine
    trace.write_text('{"request_id": "earlier"}\n')
    with pytest.raises(ValueError, match="already exists"):
        engine_kwargs(VTokenConfig(trace_path=str(trace)))
    assert engine_kwargs(VTokenConfig(trace_path=str(trace), trace_append=True))


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "nvfp4", "fp8_inc"])
def test_a_kv_cache_dtype_vtoken_cannot_move_is_refused_in_one_line(dtype):
    """Issue 58: a quantized KV cache with per-token or per-block scales (which a move would have to carry) is
    refused at once, naming the argument, not with a worker traceback. Stock vLLM (mode off) keeps it."""
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{dtype}'") as e:
        engine_kwargs(VTokenConfig(mode="vtoken"), kv_cache_dtype=dtype)
    assert "\n" not in str(e.value)
    assert engine_kwargs(VTokenConfig(mode="off"), kv_cache_dtype=dtype)["kv_cache_dtype"] == dtype


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", None, "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_and_float_kv_caches_are_accepted(dtype):
    for mode in ("vtoken", "naive"):
        engine_kwargs(VTokenConfig(mode=mode), kv_cache_dtype=dtype)


def test_testing_knobs_are_refused_on_the_public_path():
    with pytest.raises(ValueError, match="vtoken_testing"):
        engine_kwargs(VTokenConfig(), additional_config={"vtoken_testing": {"fault": "skip_moves"}})
    with pytest.raises(ValueError):
        VTokenConfig(fault="skip_moves")


def test_the_per_request_policy_cache_is_bounded_and_never_raises():
    cache = RequestConfigs(VTokenConfig(policy="h2o"), maxsize=8)
    for i in range(100):
        policy, cfg = cache.get({"budget": 0.01 + i / 1000})
        assert cfg.budget == pytest.approx(0.01 + i / 1000) and policy.name == "h2o"
    assert len(cache) == 8
    policy, cfg = cache.get({"budget": -1})  # invalid: the engine's own config, logged, not raised
    assert cfg.budget == VTokenConfig(policy="h2o").budget and len(cache) == 8
