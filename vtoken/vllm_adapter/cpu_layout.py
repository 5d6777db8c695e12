"""The KV layout of vLLM's CPU attention backend on this machine, learned from its own cache write.

vllm/v1/attention/backends/cpu_attn.py picks a kernel per machine, dtype and shape (``_get_attn_isa``: "amx"
for bf16 where AMX tiles exist, else "vec", "vec16", "neon", ...) and the kernel decides where a token's K and V
go: the vec family stores K^T per block (``vtoken.kv.kv_layout``'s "cpu" view), AMX packs bf16 in VNNI pairs. Rather
than mirror those rules, the worker writes probes through the backend's own cache update
(``CPUAttentionBackendImpl.do_kv_cache_update``, with the layer's ISA) and learns the layout once
(``vtoken.kv.kv_layout.learn``).
"""

from __future__ import annotations

import logging

import torch

from vtoken.kv.kv_layout import LAYOUTS, Layout, TableLayout, learn, resolve

logger = logging.getLogger(__name__)


def learn_cpu_layout(attention_layers: dict, kv_dtype: torch.dtype, block_size: int, head_size: int) -> Layout:
    """The layout vLLM's CPU kernel writes for these layers: a view name ("cpu") or a ``TableLayout``."""
    writers = (x for x in attention_layers.values() if hasattr(getattr(x, "impl", None), "do_kv_cache_update"))
    layer = next(writers, None)
    if layer is None:
        raise ValueError("vToken found no attention layer with a KV cache write to learn the KV layout from")

    def write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        # Mirror of CPUAttentionBackendImpl.do_kv_cache_update's call, on a scratch cache of our own.
        layer.impl.do_kv_cache_update(layer, key, value, kv, slots.to(torch.int64))

    layout = resolve(learn(write, block_size, head_size, kv_dtype), LAYOUTS)
    name = "a table (no strided view)" if isinstance(layout, TableLayout) else repr(layout)
    logger.info("vToken: vLLM's CPU KV layout (isa %s, %s) is %s", getattr(layer, "isa", "?"), kv_dtype, name)
    return layout
