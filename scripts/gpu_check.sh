#!/usr/bin/env bash
# GPU checks for the parts of vToken that need only PyTorch (the CUDA mover: side stream + event).
# Runs on a machine with one CUDA GPU and a python3 that has torch, numpy, pytest and hypothesis
# (no vLLM needed); finishes in well under 3 minutes. Results land in $OUT (or ./gpu_out).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}; mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)'
timeout 120 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_mover.py 2>&1 | tee "$out/gpu_tests.log"
timeout 60 "$py" -m vtoken.bench core --device cuda --out "$out" 2>&1 | tee "$out/gpu_bench.log"
