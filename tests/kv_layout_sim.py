"""A KV layout no strided view describes, for vLLM-free tests: the VNNI packing of vLLM's AMX kernel (bf16)."""

from __future__ import annotations

import torch

from vtoken.kv.kv_layout import LAYOUTS, TableLayout, learn, resolve


def vnni_positions(bs: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk positions [bs, d] of K and V as vLLM's AMX kernel stores bf16 (read off a Sapphire Rapids
    machine; tests/test_vllm_cpu_layout.py compares them with the kernel where it runs): K as
    [bs/16][d/2][16 tokens][2 elements], then V as [d/16][bs/2][16 elements][2 tokens]."""
    t, e = torch.arange(bs)[:, None], torch.arange(d)[None, :]
    k = (t // 16) * (16 * d) + (e // 2) * 32 + (t % 16) * 2 + e % 2
    v = bs * d + (e // 16) * (16 * bs) + (t // 2) * 32 + (e % 16) * 2 + t % 2
    return k, v


def vnni_write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """``key``/``value`` [n, kv_heads, d] at global ``slots`` of ``kv`` [num_blocks, kv_heads, bs, 2 * d]."""
    nb, heads, bs, two_d = kv.shape
    k, v = vnni_positions(bs, two_d // 2)
    flat = kv.view(nb, heads, -1)
    b, t, h = slots // bs, slots % bs, torch.arange(heads)
    flat[b[:, None, None], h[None, :, None], k[t][:, None, :]] = key
    flat[b[:, None, None], h[None, :, None], v[t][:, None, :]] = value


def vnni_layout(bs: int, d: int) -> TableLayout:
    layout = resolve(learn(vnni_write, bs, d, torch.bfloat16), LAYOUTS)
    assert isinstance(layout, TableLayout)
    return layout
