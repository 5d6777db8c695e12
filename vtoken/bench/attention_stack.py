"""A synthetic paged-attention decode step, PyTorch only: what the GPU benchmark times and the graph test captures.

A stack of ``layers`` pre-norm decoder layers over a paged KV cache in vLLM's CUDA FlashAttention layout
(``[num_blocks, kv_heads, block_size, 2 * head_size]`` per layer), decoding one token for each of ``batch``
requests of ``context`` tokens:

    per layer: qkv = x W_qkv -> write k, v at slot_mapping -> attention over the request's blocks
               (gathered through block_table) -> x += o W_o -> x += silu(x W_gate) * (x W_up) W_down

Before its cache write, layer i calls ``wait(i)`` (the hook ``vtoken/vllm_adapter/move_waits.py`` places in
vLLM). Every per-step input lives in a static buffer (``x``, ``slot_mapping``, ``block_table``), so ``step``
can be captured into a CUDA graph and replayed. No vLLM: the GPU machine has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shapes:
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    hidden: int
    ffn: int


SHAPES = {
    "smollm2-135m": Shapes(layers=30, heads=9, kv_heads=3, head_size=64, hidden=576, ffn=1536),
    "llama-8b": Shapes(layers=32, heads=32, kv_heads=8, head_size=128, hidden=4096, ffn=14336),
}


class PagedStack:
    """The decode step above. Request r owns blocks ``r * blocks_per_req ...``; its ``context`` tokens fill
    slots 0..context-1 of them, and this step writes slot ``context`` (the cache holds one spare block per
    request). ``kv`` is the list of per-layer caches a mover binds; ``out`` the step's result."""

    def __init__(
        self,
        shapes: Shapes,
        batch: int,
        context: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cuda",
        seed: int = 0,
    ) -> None:
        s, g = shapes, torch.Generator(device=device).manual_seed(seed)
        self.shapes, self.batch, self.context, self.block_size = s, batch, context, block_size
        self.blocks_per_req = context // block_size + 1
        num_blocks = batch * self.blocks_per_req
        self.num_slots = num_blocks * block_size

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale

        qkv = (s.heads + 2 * s.kv_heads) * s.head_size
        self.w = [
            (
                rand(s.hidden, qkv, scale=s.hidden**-0.5),
                rand(s.heads * s.head_size, s.hidden, scale=(s.heads * s.head_size) ** -0.5),
                rand(s.hidden, 2 * s.ffn, scale=s.hidden**-0.5),
                rand(s.ffn, s.hidden, scale=s.ffn**-0.5),
            )
            for _ in range(s.layers)
        ]
        self.kv = [rand(num_blocks, s.kv_heads, block_size, 2 * s.head_size) for _ in range(s.layers)]
        self.x = rand(batch, s.hidden)
        self.out = torch.empty_like(self.x)
        blocks = torch.arange(num_blocks, device=device).view(batch, self.blocks_per_req)
        self.block_table = blocks
        self.slot_mapping = blocks[:, context // block_size] * block_size + context % block_size
        self._where = (self.slot_mapping // block_size, self.slot_mapping % block_size)
        self.seq_len = context + 1

    def step(self, wait: Callable[[int], None] | None = None) -> torch.Tensor:
        """One decode step into ``out``; ``wait(i)`` before layer i touches its cache."""
        s, b = self.shapes, self.batch
        x = self.x
        for i, (w_qkv, w_o, w_up, w_down) in enumerate(self.w):
            h = F.rms_norm(x, (s.hidden,))
            q, k, v = (h @ w_qkv).split([s.heads * s.head_size, s.kv_heads * s.head_size, s.kv_heads * s.head_size], -1)
            if wait is not None:
                wait(i)
            new = torch.cat([k.view(b, s.kv_heads, -1), v.view(b, s.kv_heads, -1)], -1)  # [B, kvh, 2D]
            self.kv[i].transpose(1, 2).index_put_(self._where, new)  # [block, offset] <- token
            kv = self.kv[i][self.block_table]  # [B, NB, kvh, bs, 2D]
            kv = kv.permute(0, 2, 1, 3, 4).reshape(b, s.kv_heads, -1, 2 * s.head_size)[:, :, : self.seq_len]
            o = F.scaled_dot_product_attention(
                q.view(b, s.heads, 1, s.head_size),
                kv[..., : s.head_size],
                kv[..., s.head_size :],
                enable_gqa=s.heads != s.kv_heads,
            )
            x = x + o.reshape(b, -1) @ w_o
            gate, up = (F.rms_norm(x, (s.hidden,)) @ w_up).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w_down
        self.out.copy_(x)
        return self.out

    def capture(self, wait: Callable[[int], None] | None = None) -> torch.cuda.CUDAGraph:
        """``step`` captured into a CUDA graph (warmed up on a side stream first, as torch asks)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(wait)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step(wait)
        return graph
