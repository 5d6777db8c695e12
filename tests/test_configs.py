"""Every recipe under configs/ starts: it loads, a serve config validates as ServeConfig, a `ray up` file starts a
serve config that exists, and the dtype a GPU recipe asks for runs on the GPU its cluster file provisions (vLLM
refuses bfloat16 below compute capability 8.0). configs/serve.yaml names every ServeConfig key, as it says it does.
No Ray, no engine: reads the files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cluster.config import ServeConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# GCP's accelerator types -> NVIDIA compute capability (https://developer.nvidia.com/cuda-gpus).
COMPUTE_CAPABILITY = {
    "nvidia-tesla-k80": 3.7,
    "nvidia-tesla-p4": 6.1,
    "nvidia-tesla-p100": 6.0,
    "nvidia-tesla-v100": 7.0,
    "nvidia-tesla-t4": 7.5,
    "nvidia-tesla-a100": 8.0,
    "nvidia-a100-80gb": 8.0,
    "nvidia-l4": 8.9,
    "nvidia-h100-80gb": 9.0,
    "nvidia-h100-mega-80gb": 9.0,
    "nvidia-h200-141gb": 9.0,
}
DTYPE_NEEDS = {"bfloat16": 8.0, "float16": 5.3, "float32": 0.0, "auto": 8.0}  # auto: the model's (bf16 for most)


def _serve_configs() -> list[Path]:
    return sorted(CONFIGS.glob("serve*.yaml"))


def _ray_up_files() -> list[Path]:
    return sorted(CONFIGS.glob("ray-up-*.yaml"))


def _started_config(cluster: dict) -> Path:
    """The serve config a `ray up` file's head starts (vtoken serve --config ~/vtoken/configs/<file>)."""
    commands = " ".join(cluster["head_start_ray_commands"])
    found = re.findall(r"vtoken serve --config ~/vtoken/(configs/[\w.-]+\.yaml)", commands)
    assert len(found) == 1, commands
    return ROOT / found[0]


def test_every_file_under_configs_loads():
    files = sorted(p for p in CONFIGS.iterdir() if p.is_file())
    assert {p.suffix for p in files} <= {".yaml", ".json"}, files
    for path in files:
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        assert isinstance(data, dict) and data, path.name
    for path in _serve_configs():
        assert isinstance(load_config(path), ServeConfig), path.name


@pytest.mark.parametrize("path", _ray_up_files(), ids=lambda p: p.name)
def test_a_ray_up_file_starts_a_cuda_serve_config_its_gpus_can_run(path):
    cluster = yaml.safe_load(path.read_text())
    serve = load_config(_started_config(cluster))
    assert serve.replica.num_gpus >= 1, f"{path.name} starts a CPU config on GPU nodes"
    assert serve.engine.enforce_eager is False, f"{path.name}: CUDA graphs off in the config it starts"
    needs = DTYPE_NEEDS[serve.engine.dtype]
    for node in cluster.get("available_node_types", {}).values():
        for acc in node.get("node_config", {}).get("guestAccelerators", []):
            capability = COMPUTE_CAPABILITY[acc["acceleratorType"]]
            assert capability >= needs, (
                f"{path.name}: {acc['acceleratorType']} "
                f"(compute capability {capability}) cannot run {serve.engine.dtype} (needs {needs})"
            )
    text = path.read_text()
    assert "ray get-auth-token --generate" in text and "--port-forward 50051 --port-forward 8000" in text


def test_the_dtype_check_catches_a_t4_asked_for_bfloat16():
    assert COMPUTE_CAPABILITY["nvidia-tesla-t4"] < DTYPE_NEEDS["bfloat16"] <= COMPUTE_CAPABILITY["nvidia-l4"]


def _keys(model, prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        sub = field.annotation if isinstance(field.annotation, type) else None
        if sub is not None and hasattr(sub, "model_fields"):
            out |= _keys(sub, f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


def _yaml_keys(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("vtoken", "extra"):
            out |= _yaml_keys(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def test_serve_yaml_names_every_serve_config_key():
    data = yaml.safe_load((CONFIGS / "serve.yaml").read_text())
    missing = sorted(_keys(ServeConfig) - _yaml_keys(data))
    assert not missing, f"configs/serve.yaml says it has every key; it lacks {missing}"


def test_the_docs_forward_both_ports_and_make_the_token_before_ray_up():
    serving = (ROOT / "docs" / "serving.md").read_text()
    assert "--port-forward 50051 --port-forward 8000" in serving
    assert serving.index("ray get-auth-token --generate    ") < serving.index("ray up configs/")
