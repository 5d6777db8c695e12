"""Where a token's K and V elements lie inside one block of a layer's paged KV cache (worker side, no vLLM).

Most backends store a block so that a strided view indexed ``[block, offset, ...]`` reaches every token
(``LAYOUTS`` below):

* ``cpu``   vLLM's CPU attention: ``[num_blocks, num_kv_heads, block_size * 2 * head_size]`` per layer;
            inside a (block, head) the K part is stored TRANSPOSED ``[head_size, block_size]``, followed
            by V ``[block_size, head_size]`` (vllm/v1/attention/backends/cpu_attn.py).
* ``flash`` a plain ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor whose last dim is
            K then V (the CUDA FlashAttention view ``kv.transpose(1, 2).split(head_size, -1)``).
* ``slots`` any per-slot tensor ``[num_blocks * block_size, ...]`` (e.g. attention-score accumulators
            that must travel with their tokens).

Some do not: vLLM's CPU backend on a machine with AMX stores bf16
K and V packed in VNNI pairs (K as [block_size/16][head_size/2][16 tokens][2 elements], V as
[head_size/16][block_size/2][16 elements][2 tokens], per block and kv head), which no view describes. A
``TableLayout`` covers any such layout: for each offset in a block, the positions of the token's elements
inside its (block, kv head) chunk. It is learned once per engine from the backend's own cache-write kernel
(``learn``), so vToken never guesses a layout: a layout it recognises as a view keeps the view's fast path.

A layer's cache is ``[num_blocks, num_kv_heads, ...]`` with each (block, kv head) chunk contiguous and
``2 * block_size * head_size`` elements long (K and V).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

_EXACT = 256  # every integer up to this is exact in bf16, fp16 and fp32: the probe's codes stay below it
FP8_EXACT = 8  # ... and up to this in fp8 (e5m2 has two mantissa bits: 9 is not exact)

ViewFn = Callable[[torch.Tensor, int], list[torch.Tensor]]


def _cpu_views(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    nb, heads = kv.shape[0], kv.shape[1]
    per_block = kv.reshape(nb, heads, -1)  # a view: vLLM allocates each layer contiguously
    head_size = per_block.shape[-1] // (2 * block_size)
    k_t = per_block[..., : head_size * block_size].view(nb, heads, head_size, block_size)
    v = per_block[..., head_size * block_size :].view(nb, heads, block_size, head_size)
    return [k_t.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)]  # both [nb, block_size, heads, head_size]


def _flash_views(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    return [kv.transpose(1, 2)]  # [nb, block_size, heads, 2 * head_size]


def _slot_views(t: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    return [t.view(t.shape[0] // block_size, block_size, *t.shape[1:])]


LAYOUTS: dict[str, ViewFn] = {"cpu": _cpu_views, "flash": _flash_views, "slots": _slot_views}


@dataclass(frozen=True, eq=False)
class TableLayout:
    """``index`` int64 [block_size, 2 * head_size]: the chunk position of token ``t``'s K element ``e`` at
    ``index[t, e]`` and of its V element ``e`` at ``index[t, head_size + e]``. A permutation of the chunk."""

    index: np.ndarray

    @property
    def head_size(self) -> int:
        return self.index.shape[1] // 2

    def positions(self, kv: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Flat positions in ``kv`` of the tokens at (``blocks``, ``offsets``), both int64 [n]:
        int64 [n, kv_heads, 2 * head_size] (K then V of every kv head)."""
        heads, chunk = kv.shape[1], self.index.size
        idx = torch.as_tensor(self.index, device=kv.device)
        base = (blocks[:, None] * heads + torch.arange(heads, device=kv.device)[None, :]) * chunk
        return base[:, :, None] + idx[offsets][:, None, :]

    def k_transposed(self) -> np.ndarray:
        """int64 [head_size, block_size]: chunk positions of K^T (the operand of q @ K^T)."""
        return np.ascontiguousarray(self.index[:, : self.head_size].T)

    def tokens(self, kv: torch.Tensor) -> torch.Tensor:
        """A COPY of ``kv`` as [num_blocks, block_size, kv_heads, 2 * head_size] (K then V): for references and
        tests, which read; writes go through ``positions``."""
        nb, heads = kv.shape[:2]
        flat = kv.reshape(nb, heads, -1)
        return flat[:, :, torch.as_tensor(self.index, device=kv.device)].permute(0, 2, 1, 3)


Layout = str | TableLayout


def views(tensors: Sequence[torch.Tensor], layout: str, block_size: int) -> list[torch.Tensor]:
    """Every tensor's views indexed ``[block, offset, ...]`` under the named view layout."""
    try:
        fn = LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown KV layout {layout!r}; known: {sorted(LAYOUTS)}") from None
    return [v for t in tensors for v in fn(t, block_size)]


def split(kv_caches: Sequence[torch.Tensor], layout: Layout, block_size: int):
    """(views indexed [block, offset, ...], caches moved through a TableLayout's positions)."""
    if isinstance(layout, TableLayout):
        return [], list(kv_caches)
    return views(kv_caches, layout, block_size), []


def table_of(view_fn: ViewFn, block_size: int, head_size: int) -> np.ndarray:
    """The ``TableLayout.index`` a view layout (one of ``LAYOUTS``) describes."""
    chunk = torch.arange(2 * block_size * head_size, dtype=torch.int64).view(1, 1, block_size, 2 * head_size)
    return torch.cat([v[0, :, 0, :] for v in view_fn(chunk, block_size)], dim=-1).numpy()


def learn(
    write: Callable[..., None],
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    store: torch.dtype | None = None,
    read: Callable[[torch.Tensor], torch.Tensor] | None = None,
    exact: int = _EXACT,
) -> np.ndarray:
    """The ``TableLayout.index`` of a backend, from its own cache write.

    ``write(kv, key, value, slots)`` stores ``key`` and ``value`` [n, kv_heads, head_size] (of ``dtype``) at global
    ``slots`` of ``kv`` [num_blocks, kv_heads, block_size, 2 * head_size] (of ``store``, default ``dtype``; an fp8
    cache is uint8) as the backend does; ``read(kv)`` gives its elements back as numbers (default ``kv.float()``).
    Probes over two blocks and two kv heads code each element by a digit of its token, of its own index, or its
    (block, kv head) (K positive, V negative; codes 1..``exact``, each exact in the cache's format: one probe per
    coordinate in 16- and 32-bit caches, three in fp8's): chunk c must hold (block, head) ``divmod(c, 2)`` only, and
    every chunk the same arrangement. Raises ValueError when the writes are not such a permutation."""
    bs, d = block_size, head_size
    if bs >= _EXACT or d >= _EXACT:
        raise ValueError(f"cannot probe a KV layout with block_size {bs} or head_size {d} >= {_EXACT}")
    store = store or dtype
    read = read or (lambda kv: kv.float())
    nb = heads = 2
    slots = torch.arange(nb * bs)
    token = (slots % bs)[:, None, None].expand(-1, heads, d)
    elem = torch.arange(d)[None, None, :].expand(nb * bs, heads, d)
    where = (slots // bs * heads)[:, None, None] + torch.arange(heads)[None, :, None].expand(-1, -1, d)

    def probe(value: torch.Tensor) -> np.ndarray:  # value: codes 1..exact
        kv = torch.zeros(nb, heads, bs, 2 * d, dtype=store)
        code = value.to(dtype).contiguous()
        write(kv, code, -code, slots)
        return read(kv).reshape(nb * heads, -1).round().long().numpy()

    def decode(coord: torch.Tensor, size: int) -> np.ndarray:
        """Each position's coordinate from its digits (0 where nothing was written), signed as K (+) or V (-)."""
        digits, total, sign = 1, 0, None
        while exact**digits < size:
            digits += 1
        for i in range(digits):
            got = probe(coord // exact**i % exact + 1)
            total = total + (np.abs(got) - 1) * exact**i
            sign = np.sign(got) if sign is None else np.where(sign == np.sign(got), sign, 0)
        return np.where(sign != 0, total + 1, 0) * sign

    tok, el = decode(token, bs), decode(elem, d)
    chunks = probe(where + 1)
    chunk = 2 * bs * d
    index = np.full((bs, 2 * d), -1, np.int64)
    first = (tok[0] != 0) & (el[0] != 0)
    pos = np.flatnonzero(first)
    t, e = np.abs(tok[0, pos]) - 1, np.abs(el[0, pos]) - 1
    ok = bool((t < bs).all() and (e < d).all())
    col = np.where(tok[0, pos] > 0, e, d + e)
    if ok:
        index[t, col] = pos
    ok = ok and first.all() and (index >= 0).all() and np.unique(index).size == chunk
    ok = ok and all(np.array_equal(tok[c], tok[0]) and np.array_equal(el[c], el[0]) for c in range(1, nb * heads))
    ok = ok and bool((np.abs(chunks) == np.arange(1, nb * heads + 1)[:, None]).all())
    if not ok:
        raise ValueError(
            f"the backend's KV cache write is not a per-(block, kv head) permutation (block_size {bs}, "
            f"head_size {d}, {dtype} into {store}): vToken cannot move its tokens"
        )
    return index


def resolve(index: np.ndarray, layouts: dict[str, ViewFn] = LAYOUTS) -> Layout:
    """The name of the view layout whose table ``index`` is (its fast path), else a ``TableLayout``."""
    bs, d = index.shape[0], index.shape[1] // 2
    for name, fn in layouts.items():
        if name != "slots" and np.array_equal(table_of(fn, bs, d), index):
            return name
    return TableLayout(index)
