"""How vLLM stores a KV element, and how its attention reads one back (worker side, no vLLM).

With ``kv_cache_dtype`` at ``auto`` a cache holds K and V in the model's dtype. With ``fp8``, ``fp8_e4m3`` or
``fp8_e5m2`` it holds one byte per element (a ``uint8`` tensor) that the attention kernel reads as fp8 times the
layer's scale (``Attention._k_scale_float`` / ``_v_scale_float``: 1.0 unless the checkpoint ships scales):

    stored = fp8(x / scale)          read = float(stored) * scale

vToken moves those bytes as they are (a move never requantises, so it is byte-exact and the scales stay the
layer's). Everything that reads a key or a value as a number (the attention scorer, parking's last chunk and its
boxes, the query window, recall) reads it through ``KvFormat``, the one mirror of the kernel's dequantisation.

``quantize`` mirrors the write: vLLM's CPU kernel (``ops.cpu_attn_reshape_and_cache``, called from
vllm/v1/attention/backends/cpu_attn.py ``CPUAttentionBackendImpl.do_kv_cache_update``) clamps ``x / scale`` to the
format's largest finite value and rounds toward zero; CUDA's (csrc/quantization/w8a8/fp8/common.cuh
``scaled_fp8_conversion``, via ``reshape_and_cache_flash``) clamps and rounds to nearest. The references of the
exactness tests quantise independently (tests/reference.py); tests/test_kv_dtype.py holds this one against the CPU
kernel byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# vLLM's names for its fp8 caches (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE; "fp8" is e4m3 there too).
FP8: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
UNQUANTISED = (None, "auto", "float16", "bfloat16", "float32", "half", "float")
SUPPORTED = (*UNQUANTISED, *FP8)


def element_format(cache_dtype: str | None) -> torch.dtype | None:
    """The fp8 type a ``kv_cache_dtype`` stores (None: the model's own dtype). Raises ValueError for a quantised
    cache vToken cannot read (int8, nvfp4, ...)."""
    if cache_dtype in UNQUANTISED:
        return None
    if cache_dtype in FP8:
        return FP8[cache_dtype]
    raise ValueError(f"vToken reads KV caches of dtype {', '.join(k for k in SUPPORTED if k)}; not {cache_dtype!r}")


def quantize(x: torch.Tensor, fp8: torch.dtype, scale: float = 1.0, *, nearest: bool = False) -> torch.Tensor:
    """``x`` as a cache stores it: uint8 codes of ``fp8``. Toward zero (vLLM's CPU kernel) or ``nearest`` (CUDA)."""
    top = torch.finfo(fp8).max
    y = (x.float() / scale).clamp(-top, top)
    q = y.to(fp8)
    code = q.view(torch.uint8)
    if nearest:
        return code
    # rounded up in magnitude: one code down (the magnitude bits are ordered like the values; the sign stays)
    return torch.where(q.float().abs() > y.abs(), code - 1, code)


@dataclass(frozen=True, eq=False)
class KvFormat:
    """A worker's KV element format: ``fp8`` (None: unquantised) and each layer's (k_scale, v_scale), indexed like
    the runner's ``kv_caches`` and found by a cache's ``data_ptr`` (views share it).

    Invariant: ``read``'s result is what the attention kernel computes with, element for element."""

    fp8: torch.dtype | None = None
    scales: tuple[tuple[float, float], ...] = ()
    _by_ptr: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cache_dtype: str | None, kv_caches: Sequence[torch.Tensor] = (), layers: Sequence = ()) -> KvFormat:
        """``layers``: vLLM's attention layers (``Attention`` modules with ``kv_cache`` bound), in any order."""
        fp8 = element_format(cache_dtype)
        by_ptr = {kv.data_ptr(): i for i, kv in enumerate(kv_caches)}
        scales = [(1.0, 1.0)] * len(kv_caches)
        for layer in layers:
            bound = getattr(layer, "kv_cache", None)
            t = bound[0] if isinstance(bound, (list, tuple)) and bound else bound
            i = by_ptr.get(t.data_ptr()) if isinstance(t, torch.Tensor) else None
            if i is not None:
                scales[i] = (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
        return cls(fp8, tuple(scales), by_ptr)

    @property
    def quantised(self) -> bool:
        return self.fp8 is not None

    def view(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` typed as its elements (an fp8 view of a uint8 cache; no copy). Moves may use either."""
        return kv.view(self.fp8) if self.fp8 is not None and kv.dtype == torch.uint8 else kv

    def layer(self, kv: torch.Tensor) -> int | None:
        return self._by_ptr.get(kv.data_ptr())

    def scale(self, layer: int | None) -> tuple[float, float]:
        return self.scales[layer] if layer is not None and layer < len(self.scales) else (1.0, 1.0)

    def k_scale(self, kv: torch.Tensor) -> float:
        return self.scale(self.layer(kv))[0]

    def keys(self, k: torch.Tensor, layer: int | None) -> torch.Tensor:
        """float32 keys from stored elements ``k`` (any shape) of ``layer``."""
        s = self.scale(layer)[0] if self.quantised else 1.0
        k = self.view(k).float()
        return k if s == 1.0 else k * s

    def kv(self, kv: torch.Tensor, layer: int | None, head_size: int) -> torch.Tensor:
        """float32 [..., 2 * head_size] (K then V) from stored elements of ``layer``."""
        kv = self.view(kv).float()
        if not self.quantised:
            return kv
        ks, vs = self.scale(layer)
        if ks != 1.0:
            kv[..., :head_size] *= ks
        if vs != 1.0:
            kv[..., head_size:] *= vs
        return kv


PLAIN = KvFormat()
