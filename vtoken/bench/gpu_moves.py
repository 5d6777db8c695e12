"""The GPU part of `vtoken bench core --device cuda` (PyTorch and Triton only: the GPU machine has no vLLM).

1. Mover bandwidth, in SmolLM2-135M's and an 8B model's KV shapes (the FlashAttention layout, bf16): the fused
   mover against today's unfused CudaMover and against one contiguous device-to-device ``copy_`` of the same
   bytes. Bandwidth is moved bytes per second (each token's K and V of every layer counted once).
2. A decode step of the synthetic paged-attention stack (``attention_stack.py``), captured as a CUDA graph with
   the per-layer waits inside, timed without moves, with a step's moves waited for before the forward
   (serial), and with each layer waiting only for its own group (overlapped).

GPU times come from CUDA events. For the movers a spin kernel first holds the stream while the CPU queues the
work, so the figure is the GPU's time, not the CPU's launch time (reported apart as ``issue_seconds``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vtoken.bench.attention_stack import SHAPES, PagedStack
from vtoken.core.move_batch import MoveBatch
from vtoken.kv.fused_mover import FusedMover
from vtoken.kv.mover import CudaMover

_SPIN_CYCLES = 20_000_000  # ~10 ms at H200 clocks: longer than the CPU takes to queue any mover's launches


def _gpu_seconds(fn, repeats: int) -> tuple[float, float]:
    """(median GPU seconds of ``fn``'s work on the current stream, median CPU seconds spent calling it)."""
    gpu, cpu = [], []
    for _ in range(repeats):
        torch.cuda._sleep(_SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        cpu.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / 1e3)
    return float(np.median(gpu)), float(np.median(cpu))


def _batch(rng, num_slots: int, n: int) -> MoveBatch:
    slots = rng.permutation(num_slots)[: 2 * n].astype(np.int64)
    return MoveBatch(slots[:n], slots[n:])


def mover_bandwidth(model: str, moves: int, repeats: int, bs: int = 32) -> dict:
    s, rng = SHAPES[model], np.random.default_rng(0)
    nblocks = max(4 * moves // bs, 64)
    kv = [
        torch.randn(nblocks, s.kv_heads, bs, 2 * s.head_size, dtype=torch.bfloat16, device="cuda")
        for _ in range(s.layers)
    ]
    batch = _batch(rng, nblocks * bs, moves)
    nbytes = moves * s.layers * s.kv_heads * 2 * s.head_size * 2
    row = {"model": model, "layers": s.layers, "tokens_moved": moves, "bytes": nbytes}
    fused = FusedMover(bs, "flash", "cuda")
    today = CudaMover(bs, "flash", "cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for name, fn in (
        ("fused", lambda: (fused.apply(kv, batch), fused.wait())),
        ("today", lambda: (today.apply(kv, batch), today.wait())),
        ("copy", lambda: dst.copy_(src)),
    ):
        fn()  # compile, bind, warm the caches
        torch.cuda.synchronize()
        sec, issue = _gpu_seconds(fn, repeats)
        row[name] = {"seconds": sec, "gbps": nbytes / sec / 1e9, "issue_seconds": issue}
    row["fused"]["launches_per_step"] = fused.launches // (repeats + 1)
    row["fused_vs_copy"] = row["copy"]["seconds"] / row["fused"]["seconds"]
    row["fused_vs_today"] = row["today"]["seconds"] / row["fused"]["seconds"]
    return row


def stack_step(model: str, batch: int, context: int, moves_per_request: list[int], steps: int, rounds: int) -> dict:
    """Step times of the captured stack: no moves, then per scenario serial and overlapped."""
    s, bs, rng = SHAPES[model], 16, np.random.default_rng(1)
    stack = PagedStack(s, batch, context, block_size=bs)
    mover = FusedMover(bs, "flash", "cuda")
    mover.bind(stack.kv)
    graph = stack.capture(mover.wait_layer)

    def timed(pre) -> float:
        pre()  # compile this batch's kernels before timing
        graph.replay()
        per = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                pre()
                graph.replay()
            end.record()
            end.synchronize()
            per.append(start.elapsed_time(end) / 1e3 / steps)
        return float(np.median(per))

    base = timed(lambda: None)
    out = {"model": model, "batch": batch, "context": context, "layers": s.layers, "no_moves_seconds": base}
    out["scenarios"] = []
    per_req = stack.blocks_per_req * bs
    for k in moves_per_request:
        src, dst = [], []
        for r in range(batch):  # within each request's context: its attention reads the moved slots
            slots = r * per_req + rng.permutation(context)[: 2 * k]
            src.append(slots[:k])
            dst.append(slots[k:])
        moves = MoveBatch(np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64))
        serial = timed(lambda m=moves: (mover.apply(stack.kv, m), mover.wait()))
        overlapped = timed(lambda m=moves: mover.apply(stack.kv, m))
        nbytes = len(moves) * mover.token_bytes
        out["scenarios"].append(
            {
                "moves_per_request": k,
                "moves": len(moves),
                "bytes": nbytes,
                "serial_seconds": serial,
                "overlapped_seconds": overlapped,
                "serial_ratio": serial / base,
                "overlapped_ratio": overlapped / base,
            }
        )
    return out


def run(moves: int, repeats: int, quick: bool) -> dict:
    models = ["smollm2-135m"] if quick else list(SHAPES)
    result = {"device_name": torch.cuda.get_device_name(0), "movers": [], "stack": []}
    for m in models:
        result["movers"].append(mover_bandwidth(m, moves, repeats))
    cases = {"smollm2-135m": (64, 2048), "llama-8b": (32, 2048)}
    for m in models:
        batch, context = (8, 256) if quick else cases[m]
        scenarios = [1, 16] if quick else [1, 16, 256]
        result["stack"].append(stack_step(m, batch, context, scenarios, steps=5 if quick else 10, rounds=5))
        torch.cuda.empty_cache()  # the stack's weights and graph pool, before the next model's
    return result
