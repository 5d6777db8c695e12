"""The scorer's hook into vLLM: every attention layer's ``impl.forward`` hands its query, KV cache and output over.

vllm/model_executor/layers/attention/attention.py calls ``layer.impl.forward(layer, query, key, value,
kv_cache, attn_metadata, ...)`` after RoPE, with the step's KV already written; the wrapper below passes
those to ``AttentionScorer.observe`` once the layer's own attention is done, and its output (``[num_tokens, heads,
head_size]``, vLLM's ``output`` buffer) to parking's tier, which rewrites the rows of a last prompt chunk that must
attend the parked tokens too (vtoken/kv/tier.py), before the next layer reads them. The scorer itself
(``vtoken/kv/scores.py``) knows no vLLM beyond four metadata field names, so it is tested, and checked on a
GPU, without vLLM.

On CUDA the hook runs between the pieces of vLLM's piecewise CUDA graphs (attention is a splitting op there),
never inside a captured graph. Per step the model runner calls ``reset_slots`` (slots written this step) and
``begin_step`` (rows to observe and how many of their last queries) before the forward, and ``end_step`` after.
"""

from __future__ import annotations

import torch

from vtoken.kv.scores import AttentionScorer

__all__ = ["AttentionScorer", "Observers", "install"]


class Observers:
    """Several observers of every attention layer (the scorer, parking's joint window), called in order."""

    def __init__(self, *observers) -> None:
        self.observers = [o for o in observers if o is not None]

    def observe(self, query, kv_cache, attn_metadata, scale: float, output=None) -> None:
        for o in self.observers:
            o.observe(query, kv_cache, attn_metadata, scale, output)


# A full CUDA graph would replay attention without calling the hook (and the hook allocates): engine_kwargs keeps
# graphs piecewise when a scorer runs, so attention runs eagerly between captured pieces; this says so if not.
CAPTURED = (
    "vToken's attention scorer runs at every step and cannot be captured into a full CUDA graph: use "
    "compilation_config={'cudagraph_mode': 'PIECEWISE'} (vtoken.vllm_adapter.engine_kwargs sets it)"
)


def install(attention_layers: dict, scorer: AttentionScorer | Observers) -> int:
    """Wrap every attention layer's impl.forward so the scorer sees its query and KV cache."""
    n = 0
    for layer in attention_layers.values():
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(impl, "_vtoken_wrapped", False) or not hasattr(impl, "forward"):
            continue
        orig = impl.forward

        def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, _orig=orig, _impl=impl, **kw):
            if query.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(CAPTURED)
            out = _orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kw)
            if attn_metadata is not None and kv_cache is not None and kv_cache.numel():
                scorer.observe(query, kv_cache, attn_metadata, _impl.scale, out)  # parking's last chunk rewrites out
            return out

        impl.forward = forward
        impl._vtoken_wrapped = True
        n += 1
    return n
