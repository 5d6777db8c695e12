"""Core micro-benchmarks: TokenTable bytes per token, planner moves against the lower bound, mover bandwidth.

The mover is timed against a plain ``copy_`` of the same number of bytes (one contiguous buffer per
layer), on a KV cache shaped like SmolLM2-135M's in vLLM's CPU layout (30 layers, 3 KV heads of 64, bf16).
With ``--device cuda`` the mover figures come from ``gpu_moves.py`` instead (no vLLM needed): the fused mover
against today's CudaMover and one contiguous copy, in SmolLM2's and an 8B model's shapes, and a synthetic
paged-attention step with and without a step's moves, serial and overlapped.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vtoken.core.move_batch import MoveBatch
from vtoken.core.planner import moves_lower_bound, plan_compaction, plan_compaction_reference
from vtoken.core.token_table import TokenTable
from vtoken.kv.mover_factory import make_mover


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
    }
    print(f"TokenTable: {bytes_per_token:.2f} bytes/token at {tokens} tokens ({table.nbytes} B)")
    print(
        f"planner: {plan.num_moves} moves, lower bound {result['planner']['lower_bound']}, order-preserving "
        f"reference {ref.num_moves}; {len(blocks)} -> {plan.keep_blocks} blocks in {plan_s * 1e3:.2f} ms"
    )
    # Mover against copy_
    device = torch.device(args.device)
    if device.type == "cuda":
        return {**result, **_cuda(n_moves, repeats, args.quick)}
    layers, heads, hs, nblocks = 30, 3, 64, max(4 * n_moves // bs, 64)
    kv = [torch.randn(nblocks, heads, bs * 2 * hs, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    slots = rng.permutation(nblocks * bs)
    batch = MoveBatch(slots[:n_moves].astype(np.int64), slots[n_moves : 2 * n_moves].astype(np.int64))
    mover = make_mover(device, bs, "cpu")
    sync = lambda: None  # noqa: E731 - the CPU mover and copy_ return when done
    move_s = _best(lambda: mover.apply(kv, batch), repeats, sync)
    nbytes = n_moves * layers * heads * 2 * hs * 2
    src = [torch.randn(nbytes // layers // 2, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    dst = [torch.empty_like(s) for s in src]
    copy_s = _best(lambda: [d.copy_(s) for d, s in zip(dst, src)], repeats, sync)
    result["mover"] = {
        "device": str(device),
        "tokens_moved": n_moves,
        "bytes": nbytes,
        "seconds": move_s,
        "gbps": nbytes / move_s / 1e9,
        "copy_seconds": copy_s,
        "copy_gbps": nbytes / copy_s / 1e9,
        "ratio_to_copy": copy_s / move_s,
    }
    print(
        f"mover ({device}): {nbytes / 1e6:.1f} MB in {move_s * 1e3:.2f} ms = {result['mover']['gbps']:.2f} GB/s; "
        f"plain copy_ {result['mover']['copy_gbps']:.2f} GB/s; mover/copy = {result['mover']['ratio_to_copy']:.2f}"
    )
    return result


def _cuda(n_moves: int, repeats: int, quick: bool) -> dict:
    from vtoken.bench import gpu_moves

    gpu = gpu_moves.run(n_moves, repeats, quick)
    m = gpu["movers"][0]  # SmolLM2's shapes: the "mover" figures of the CPU run
    mover = {
        "device": "cuda",
        "tokens_moved": m["tokens_moved"],
        "bytes": m["bytes"],
        "seconds": m["fused"]["seconds"],
        "gbps": m["fused"]["gbps"],
        "copy_seconds": m["copy"]["seconds"],
        "copy_gbps": m["copy"]["gbps"],
        "ratio_to_copy": m["fused_vs_copy"],
    }
    for m in gpu["movers"]:
        print(
            f"mover ({m['model']}, cuda): {m['bytes'] / 1e6:.1f} MB: fused {m['fused']['gbps']:.0f} GB/s "
            f"({m['fused']['launches_per_step']} launches), today's {m['today']['gbps']:.1f} GB/s, "
            f"contiguous copy_ {m['copy']['gbps']:.0f} GB/s; fused/copy = {m['fused_vs_copy']:.2f}"
        )
    for st in gpu["stack"]:
        for sc in st["scenarios"]:
            print(
                f"stack ({st['model']}, batch {st['batch']} x {st['context']}): no moves "
                f"{st['no_moves_seconds'] * 1e3:.3f} ms; {sc['moves']} moves: serial x{sc['serial_ratio']:.3f}, "
                f"overlapped x{sc['overlapped_ratio']:.3f}"
            )
    return {"mover": mover, "gpu": gpu}


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
    ] + (_gpu_tables(result["gpu"]) if "gpu" in result else [])


def _gpu_tables(gpu: dict):
    from vtoken.bench.report import Table

    movers = Table(
        f"Movers on {gpu['device_name']} (bf16, FlashAttention layout; GB/s of moved bytes)",
        ["shapes", "MB moved", "fused", "launches", "today's", "contiguous copy_", "fused / copy"],
        [
            [
                m["model"],
                m["bytes"] / 1e6,
                m["fused"]["gbps"],
                m["fused"]["launches_per_step"],
                m["today"]["gbps"],
                m["copy"]["gbps"],
                m["fused_vs_copy"],
            ]
            for m in gpu["movers"]
        ],
    )
    stack = Table(
        "Synthetic paged-attention decode step (CUDA graph), a step's moves serial and overlapped",
        ["shapes", "batch x context", "no moves ms", "moves", "MB", "serial", "overlapped"],
        [
            [
                st["model"],
                f"{st['batch']} x {st['context']}",
                st["no_moves_seconds"] * 1e3,
                sc["moves"],
                sc["bytes"] / 1e6,
                f"x{sc['serial_ratio']:.3f}",
                f"x{sc['overlapped_ratio']:.3f}",
            ]
            for st in gpu["stack"]
            for sc in st["scenarios"]
        ],
    )
    return [movers, stack]
