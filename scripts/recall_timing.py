"""One recall's cost at a model's shapes: the summary path (page boxes on the pool's device, then the best pages'
keys from host memory) and the exact path (every parked key), time and bytes read from host memory per recall.
Synthetic keys and queries (the cost does not depend on their values); no vLLM. On a GPU the parked keys are in
pinned host memory and the bytes cross PCIe; on a CPU they are plain memory.

    python scripts/recall_timing.py --device cuda --contexts 16384,131072      # Llama-3.1-8B's shapes
    python scripts/recall_timing.py --device cpu --contexts 4096 --layers 4    # a quick look on a CPU

Prints one JSON object: per context, the parked tokens, candidates, bytes per recall, and milliseconds per recall
(the median of ``--reps``), each path."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken.core.move_batch import MoveBatch  # noqa: E402
from vtoken.kv.query_window import QueryWindow  # noqa: E402
from vtoken.kv.tier import KVTier  # noqa: E402
from vtoken.vllm_adapter.model_runner import recall_candidates  # noqa: E402


def one(context: int, args) -> dict:
    dev = torch.device(args.device)
    bs, layers, kvh, heads, d = 32, args.layers, args.kv_heads, args.heads, args.head_size
    live = int(context * args.budget)
    parked = context - live
    blocks = -(-live // bs) + 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    kv = [torch.randn(blocks + -(-parked // bs), kvh, bs, 2 * d, dtype=dtype, device=dev) for _ in range(layers)]
    tier = KVTier(parked, kv, "flash", bs, d)
    src = np.arange(blocks * bs, blocks * bs + parked)  # park the tokens of the blocks past the live ones
    tier.park(kv, [], MoveBatch(src, np.arange(parked)))
    tier._land()
    window = QueryWindow(1, kv, "flash", bs, heads, d, window=16)
    row = window.row_of("r")
    q = torch.randn(layers, 1, heads, d, dtype=dtype, device=dev)
    for t in range(16):
        window.begin([(row, 0, live - 16 + t)])
        for layer, k in enumerate(kv):
            window.record(q[layer], k, None, d**-0.5)
    block_ids = list(range(blocks))
    out = {"context": context, "live": live, "parked": parked}
    for name, candidates in (("summary", recall_candidates(live, tier.PAGE)), ("exact", None)):
        times = []
        for _ in range(args.reps):
            before = tier.bytes_recalled
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            window.score_with_parked(row, block_ids, live, kv, tier, np.arange(parked), candidates)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            read = tier.bytes_recalled - before
        out[name] = {"candidates": candidates or parked, "bytes_from_host_per_recall": read,
                     "ms_per_recall": 1000 * float(np.median(times))}  # fmt: skip
    box = 2 * -(-parked // tier.PAGE) * layers * kvh * d * 4
    out["box_bytes_on_device"] = box
    out["summary"]["bytes_per_decode_step_at_recall_every_16"] = out["summary"]["bytes_from_host_per_recall"] / 16
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default="16384,131072")
    p.add_argument("--budget", type=float, default=0.25, help="live share of the context (the rest is parked)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    rows = [one(int(c), args) for c in args.contexts.split(",")]
    print(json.dumps({"device": args.device, "shapes": {"layers": args.layers, "kv_heads": args.kv_heads,
                      "heads": args.heads, "head_size": args.head_size}, "budget": args.budget, "rows": rows},
                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
