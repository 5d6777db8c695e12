"""The `vtoken` command: argument errors, models list, and the benchmarks' --quick smoke runs (structure only)."""

import json
import subprocess
import sys

import pytest

VTOKEN = [sys.executable, "-m", "vtoken.cli"]


def vt(*args, **kw):
    return subprocess.run(VTOKEN + list(args), capture_output=True, text=True, timeout=900, **kw)


def test_models_list_shows_prepared_models():
    r = vt("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    names = {m["name"]: m for m in json.loads(r.stdout)}
    assert names["tiny-llama"]["prepared"] and names["smollm2-135m"]["prepared"]


def test_demo_rejects_bad_arguments_clearly():
    r = vt("demo", "--policy", "lru")
    assert r.returncode == 2 and "unknown eviction policy" in r.stderr
    r = vt("demo", "--modes", "off,fast")
    assert r.returncode == 2 and "--modes" in r.stderr


def test_bench_core_quick(tmp_path):
    r = vt("bench", "core", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "core.json").read_text())
    assert out["table"]["bytes_per_token"] <= 8
    assert out["planner"]["moves"] == out["planner"]["lower_bound"]
    assert out["mover"]["gbps"] > 0 and {"machine", "settings", "seconds"} <= set(out)


@pytest.mark.vllm
def test_bench_overhead_quick(tmp_path):
    r = vt("bench", "overhead", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "overhead.json").read_text())
    assert [row["mode"] for row in out["rows"]] == ["off", "vtoken-streaming", "vtoken-h2o", "naive-h2o"]
    assert all(row["ms_per_step"] > 0 for row in out["rows"])
