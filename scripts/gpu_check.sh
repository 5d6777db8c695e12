#!/usr/bin/env bash
# GPU checks for the parts of vToken that need only PyTorch: the CUDA mover (side stream + event) and the
# attention scorer in the CUDA layout (against its plain reference, fp32/bf16/fp16, with compaction between
# steps, and without host synchronisation), then a mover and a scorer micro-benchmark on the device.
# Runs on a machine with one CUDA GPU and a python3 that has torch, numpy, pytest and hypothesis
# (no vLLM needed); finishes in well under 3 minutes. Results land in $OUT (or ./gpu_out).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}; mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)'
timeout 120 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_mover.py tests/test_scores.py 2>&1 | tee "$out/gpu_tests.log"
timeout 60 "$py" -m vtoken.bench core --device cuda --out "$out" 2>&1 | tee "$out/gpu_bench.log"
# The scorer per decode step at three context lengths (4 requests, SmolLM2's shapes), bf16 as served.
timeout 60 "$py" -m vtoken.bench.overhead --device cuda --dtype bfloat16 --lengths 1024,4096,16384 \
  > "$out/gpu_scorer.json" 2> >(tee "$out/gpu_scorer.log" >&2)
cat "$out/gpu_scorer.json"
