"""Core micro-benchmarks: TokenTable bytes per token, planner moves against the lower bound, mover bandwidth.

The mover is timed against a plain ``copy_`` of the same number of bytes (one contiguous buffer per
layer), on a KV cache shaped like SmolLM2-135M's in vLLM's CPU layout (30 layers, 3 KV heads of 64, bf16).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vtoken.mover import MoveBatch, make_mover
from vtoken.planner import moves_lower_bound, plan_compaction, plan_compaction_reference
from vtoken.token_table import TokenTable


def add_args(p) -> None:
    p.add_argument("--tokens", type=int, default=16384, help="context length for the table and planner")
    p.add_argument("--moves", type=int, default=4096, help="tokens moved per mover call")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cpu")


def _best(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(args) -> dict:
    tokens, n_moves, repeats = (2048, 512, 3) if args.quick else (args.tokens, args.moves, args.repeats)
    bs = 32
    rng = np.random.default_rng(0)
    # TokenTable metadata
    table = TokenTable(bs)
    for _ in range(tokens // 256):
        table.append(256)
    bytes_per_token = table.nbytes / table.num_logical
    # Planner on a random 25%-live trace
    table.kill(rng.choice(tokens, size=int(0.75 * tokens), replace=False))
    live = table.physical_live_mask()
    blocks = list(range(table.num_blocks))
    t0 = time.perf_counter()
    plan = plan_compaction(live, blocks, bs)
    plan_s = time.perf_counter() - t0
    ref = plan_compaction_reference(live, blocks, bs)
    # Mover against copy_
    device = torch.device(args.device)
    layers, heads, hs, nblocks = 30, 3, 64, max(4 * n_moves // bs, 64)
    kv = [torch.randn(nblocks, heads, bs * 2 * hs, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    slots = rng.permutation(nblocks * bs)
    batch = MoveBatch(slots[:n_moves].astype(np.int64), slots[n_moves : 2 * n_moves].astype(np.int64))
    mover = make_mover(device, bs, "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    move_s = _best(lambda: mover.apply(kv, batch), repeats, sync)
    nbytes = n_moves * layers * heads * 2 * hs * 2
    src = [torch.randn(nbytes // layers // 2, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    dst = [torch.empty_like(s) for s in src]
    copy_s = _best(lambda: [d.copy_(s) for d, s in zip(dst, src)], repeats, sync)
    result = {
        "table": {"tokens": tokens, "nbytes": table.nbytes, "bytes_per_token": bytes_per_token},
        "planner": {
            "live_fraction": 0.25,
            "moves": plan.num_moves,
            "lower_bound": moves_lower_bound(live, bs),
            "reference_moves": ref.num_moves,
            "seconds": plan_s,
            "blocks_before": len(blocks),
            "blocks_after": plan.keep_blocks,
        },
        "mover": {
            "device": str(device),
            "tokens_moved": n_moves,
            "bytes": nbytes,
            "seconds": move_s,
            "gbps": nbytes / move_s / 1e9,
            "copy_seconds": copy_s,
            "copy_gbps": nbytes / copy_s / 1e9,
            "ratio_to_copy": copy_s / move_s,
        },
    }
    print(f"TokenTable: {bytes_per_token:.2f} bytes/token at {tokens} tokens ({table.nbytes} B)")
    print(
        f"planner: {plan.num_moves} moves, lower bound {result['planner']['lower_bound']}, order-preserving "
        f"reference {ref.num_moves}; {len(blocks)} -> {plan.keep_blocks} blocks in {plan_s * 1e3:.2f} ms"
    )
    print(
        f"mover ({device}): {nbytes / 1e6:.1f} MB in {move_s * 1e3:.2f} ms = {result['mover']['gbps']:.2f} GB/s; "
        f"plain copy_ {result['mover']['copy_gbps']:.2f} GB/s; mover/copy = {result['mover']['ratio_to_copy']:.2f}"
    )
    return result


def tables(result: dict):
    from vtoken.bench.report import Table

    t, p, m = result["table"], result["planner"], result["mover"]
    return [
        Table(
            "Core figures",
            ["figure", "value"],
            [
                ["TokenTable bytes per token", f"{t['bytes_per_token']:.2f} at {t['tokens']} tokens ({t['nbytes']} B)"],
                [
                    "planner moves (lower bound, order-preserving reference)",
                    f"{p['moves']} ({p['lower_bound']}, {p['reference_moves']})",
                ],
                [
                    "blocks before -> after compaction",
                    f"{p['blocks_before']} -> {p['blocks_after']} in {1000 * p['seconds']:.2f} ms",
                ],
                [f"mover ({m['device']}) GB/s vs plain copy_", f"{m['gbps']:.2f} vs {m['copy_gbps']:.2f}"],
            ],
        )
    ]
