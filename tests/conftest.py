import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Offline engines (vllm.LLM) run their EngineCore in this process: an engine starts in ~5 s instead of
# ~40 s (no second interpreter importing torch and vLLM), which keeps CI in its time budget. AsyncLLM
# (the Ray replicas) always runs its EngineCore in its own process, so serving tests are unaffected.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
