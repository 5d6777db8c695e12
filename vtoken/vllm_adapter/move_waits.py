"""Per-layer waits: each attention layer touches its KV cache only once that layer's moves of the step are done.

The fused mover (``vtoken/kv/fused_mover.py``) issues a step's moves on a side stream at the start of
``execute_model`` and records one event per group of layers (1, 2, 4, ... layers). The forward's stream waits
for each group only where the group's first layer first touches its cache; the layers before it run while the
group's moves do. The waits, in the order a layer runs (vllm/model_executor/layers/attention/attention.py):

    Attention.forward
      unified_kv_cache_update   -> impl.do_kv_cache_update   WAIT, then write this step's K and V at
                                                             slot_mapping (a slot there may be a move's source:
                                                             the tail of a request just packed, or a block
                                                             another request freed in this step)
      unified_attention_with_output -> impl.forward          WAIT (already satisfied on the same stream), then
                                                             attention; it is the first touch for a layer that
                                                             shares another layer's cache and for backends that
                                                             write the cache inside forward

Before the forward the runner makes its stream wait only for what no hook covers (``wait_unhooked``: the
per-slot statistics, which ``_prepare_inputs`` resets, and any layer without a hook), or for everything when
vLLM itself zeroes or copies blocks first (model_runner.py ``_vt_order_moves``). A wait is a stream-to-event
dependency: the CPU never blocks.

CUDA graphs. With vLLM's piecewise graphs both ops above are splitting ops (CompilationConfig.
set_splitting_ops_for_v1), so the hooks run eagerly between captured pieces every step. With full graphs they
run once, while vLLM captures: each wait becomes an event-wait node on the mover's external event, which at
every replay waits for the moves last recorded on it (and, in a step without moves, for long-finished work).
The hooks allocate nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vtoken.kv.mover import Mover

__all__ = ["install"]


def install(
    attention_layers: dict, mover: Mover, kv_caches: Sequence[torch.Tensor], extra: Sequence[torch.Tensor]
) -> int:
    """Bind ``mover`` to the caches and per-slot tensors, and make every attention layer of
    ``attention_layers`` (vLLM's static_forward_context) wait for its own group. Returns the layers newly hooked;
    0 for a mover without per-layer events (CPU, the unfused CudaMover), whose moves the runner waits for whole."""
    if not mover.per_layer:
        return 0
    mover.bind(kv_caches, extra)
    hooked = 0
    for layer in attention_layers.values():
        impl, kv = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
        if isinstance(kv, list | tuple):  # one cache per virtual engine in older vLLM releases
            kv = kv[0] if kv else None
        index = mover.layer_of(kv) if isinstance(kv, torch.Tensor) else None
        if impl is None or index is None:
            continue  # the runner's wait before the forward covers this layer's group
        if getattr(impl, "_vtoken_waits", None) is not mover:  # wrapped once per mover
            for name in ("do_kv_cache_update", "forward"):
                if hasattr(impl, name):
                    setattr(impl, name, _waiting(getattr(impl, name), mover, index))
            impl._vtoken_waits = mover
            hooked += 1
        mover.hooked.add(index)
    return hooked


def _waiting(fn, mover, index: int):
    def wrapped(*args, **kwargs):
        mover.wait_layer(index)  # the current stream waits for this layer's group; nothing blocks the CPU
        return fn(*args, **kwargs)

    return wrapped
