"""The KV layout of vLLM's CPU attention backend on this machine, learned from its own cache write.

vllm/v1/attention/backends/cpu_attn.py picks a kernel per machine, dtype and shape (``_get_attn_isa``: "amx"
for bf16 where AMX tiles exist, else "vec", "vec16", "neon", ...) and the kernel decides where a token's K and V
go: the vec family stores K^T per block (``vtoken.kv.kv_layout``'s "cpu" view), AMX packs bf16 in VNNI pairs, and an
fp8 cache (one byte an element) is packed per kernel too. Rather than mirror those rules, the worker writes probes
through the backend's own cache update (``CPUAttentionBackendImpl.do_kv_cache_update``, with the layer's ISA and
scales) and learns the layout once (``vtoken.kv.kv_layout.learn``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from vtoken.kv.kv_dtype import KvFormat
from vtoken.kv.kv_layout import FP8_EXACT, LAYOUTS, Layout, TableLayout, learn, resolve

logger = logging.getLogger(__name__)


def learn_cpu_layout(
    attention_layers: dict,
    kv_dtype: torch.dtype,
    block_size: int,
    head_size: int,
    fmt: KvFormat | None = None,
    model_dtype: torch.dtype | None = None,
) -> Layout:
    """The layout vLLM's CPU kernel writes for these layers: a view name ("cpu") or a ``TableLayout``.
    ``kv_dtype``: the cache tensor's dtype (uint8 for fp8, with ``fmt`` saying which fp8 and ``model_dtype`` the
    dtype of the keys and values written into it)."""
    writers = (x for x in attention_layers.values() if hasattr(getattr(x, "impl", None), "do_kv_cache_update"))
    layer = next(writers, None)
    if layer is None:
        raise ValueError("vToken found no attention layer with a KV cache write to learn the KV layout from")
    quantised = fmt is not None and fmt.quantised
    # An fp8 cache stores fp8(x / scale), rounded toward zero: with the layer's own scales a code c could come back
    # as c - 1. do_kv_cache_update reads only the layer's ``isa`` and scales, so the probe passes a stand-in with
    # unit scales (the layout does not depend on them).
    probe_layer = SimpleNamespace(isa=getattr(layer, "isa", None), _k_scale_float=1.0, _v_scale_float=1.0)

    def write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        # Mirror of CPUAttentionBackendImpl.do_kv_cache_update's call, on a scratch cache of our own.
        layer.impl.do_kv_cache_update(probe_layer if quantised else layer, key, value, kv, slots.to(torch.int64))

    if quantised:
        index = learn(write, block_size, head_size, model_dtype or torch.float32, store=kv_dtype,
                      read=lambda kv: fmt.view(kv).float(), exact=FP8_EXACT)  # fmt: skip
    else:
        index = learn(write, block_size, head_size, kv_dtype)
    layout = resolve(index, LAYOUTS)
    name = "a table (no strided view)" if isinstance(layout, TableLayout) else repr(layout)
    what = f"{fmt.fp8} in {kv_dtype}" if quantised else str(kv_dtype)
    logger.info("vToken: vLLM's CPU KV layout (isa %s, %s) is %s", getattr(layer, "isa", "?"), what, name)
    return layout
