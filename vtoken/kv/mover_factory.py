"""Which mover a device gets: above both movers (vtoken/kv/mover.py, vtoken/kv/fused_mover.py), so neither imports the
other."""

from __future__ import annotations

import torch

from vtoken.kv.kv_layout import Layout
from vtoken.kv.mover import CpuMover, CudaMover, Mover


def make_mover(device: torch.device | str, block_size: int, layout: Layout | None = None) -> Mover:
    """The mover for a device: on CUDA the fused mover (``vtoken/kv/fused_mover.py``: Triton, a few launches a step,
    an event per layer group) for the FlashAttention layout, the side-stream CudaMover for a layout whose tokens
    are not rows of contiguous elements or where Triton is missing; the batched CpuMover elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        layout = layout or "flash"
        if layout == "flash":
            try:
                from vtoken.kv.fused_mover import FusedMover
            except ImportError:  # no Triton: the unfused mover still runs
                return CudaMover(block_size, layout, device)
            return FusedMover(block_size, layout, device)
        return CudaMover(block_size, layout, device)
    return CpuMover(block_size, layout or "cpu")
