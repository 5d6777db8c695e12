#!/usr/bin/env bash
# GPU checks for the parts of vToken that need only PyTorch and Triton (no vLLM on the GPU machine):
#  1. tests marked gpu: the fused mover against the per-move reference (fp32/bf16/fp16/fp8 bytes, a block reused in the
#     same step), no host synchronisation, the per-layer waits with a planted missing wait, a captured CUDA
#     graph of an attention stack reading the slots the mover just wrote (and one without the waits, caught);
#     today's CudaMover; the attention scorer in the CUDA layout against its reference; the parking tier in
#     pinned host memory (side-stream copies, the last chunk attending parked keys streamed from the host); an fp8
#     e4m3 cache with per-layer scales read by the scorer, the tier and the query window, and moved as uint8 bytes.
#  2. `vtoken bench core --device cuda`: the fused mover's GB/s against a contiguous copy_ of the same bytes and
#     against today's mover (SmolLM2's and an 8B model's shapes), and a synthetic paged-attention decode step
#     (CUDA graph) without moves, with a step's moves serial and overlapped.
#  3. the scorer per decode step at three context lengths.
#  4. recall (issue 42): the summary path (page boxes on the device, the best pages' keys from pinned host memory)
#     against the exact path at Llama-3.1-8B's shapes, 16K and 128K contexts: ms and bytes over PCIe per recall.
# Runs on a machine with one CUDA GPU and a python3 that has torch (with Triton), numpy, pytest and hypothesis;
# the four steps are capped at 80 + 60 + 35 + 40 s, so it ends in under 4 minutes. Results land in $OUT (or ./gpu_out).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}; mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
"$py" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__, "triton", triton.__version__)'
status=0
timeout 80 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_mover.py tests/test_cuda_graph_moves.py \
  tests/test_mover.py tests/test_scores.py tests/test_park.py tests/test_query_window.py tests/test_recall_scores.py \
  tests/test_kv_format.py \
  2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 60 "$py" -m vtoken.bench core --device cuda --out "$out" 2>&1 | tee "$out/gpu_bench.log" || status=1
# The scorer per decode step at three context lengths (4 requests, SmolLM2's shapes), bf16 as served.
timeout 35 "$py" -m vtoken.bench.overhead --device cuda --dtype bfloat16 --lengths 1024,4096,16384 \
  > "$out/gpu_scorer.json" 2> >(tee "$out/gpu_scorer.log" >&2) || status=1
cat "$out/gpu_scorer.json"
timeout 40 "$py" scripts/recall_timing.py --device cuda --contexts 16384,131072 --reps 3 > "$out/gpu_recall.json" \
  || status=1
cat "$out/gpu_recall.json"
exit $status
