"""The fused move kernel: copies token rows between slots of many tensors ("pools") in one launch (no vLLM).

A pool is one tensor whose tokens are rows of contiguous machine words. In words, relative to the lowest
address among the launch's pools (so every offset is non-negative):

    row r of slot s = base + (s // block_size) * block_stride + (s % block_size) * slot_stride + r * row_stride

with ``rows`` rows of ``row_words`` words each. One row of vLLM's CUDA FlashAttention cache
``[num_blocks, kv_heads, block_size, 2 * head_size]`` is one kv head's K and V of a token (rows = kv heads);
a per-slot statistic ``[num_slots]`` is one row of one element. Words are the widest of 8, 4, 2 or 1 bytes
that divide every base, stride and row of the launch, so a launch copies bytes, whatever each pool's dtype
(bit-exact: NaN payloads and int64 counters alike).

One launch covers every pool of a group (grid: move tiles x pools) and runs one of two phases:

    phase 0  for move i < n_direct + n_staged: read src[i]; write dst[i] if i < n_direct,
             else staging row i - n_direct
    phase 1  for staged move j < n_staged:     read staging row j; write dst[n_direct + j]

The caller orders each batch so that a "direct" move writes a slot no move reads; then phase 0 reads every
source before any write could clobber it, whatever order its programs run in, and phase 1 (a second
launch, stream-ordered after the first) writes the slots that other moves read. A batch with no such slot
needs one launch per group. ``Launch`` turns a group's tensors into the pool table; ``vtoken/kv/fused_mover.py``
owns the ordering, the buffers and the streams.

The kernel is built twice from one Python function: ``triton.jit`` for CUDA tensors and Triton's
interpreter for CPU tensors (the CPU tests). Choosing the interpreter by device, rather than through
``TRITON_INTERPRET=1`` (read when ``triton.jit`` decorates a function), leaves every other Triton kernel of
the process as it is.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

POOL_FIELDS = 7  # base, block_stride, slot_stride, row_stride, rows, row_words, stage_offset (all in words)
WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _move_rows(
    words,  # *word: the launch's lowest-addressed pool; every base is relative to it
    pools,  # int64 [P, POOL_FIELDS]
    src,  # int32 [>= n_direct + n_staged]: source slots, direct moves first
    dst,  # int32 [>= n_direct + n_staged]: destination slots, same order
    stage,  # *word: staging rows, stage_words per staged move
    n_direct,
    n_staged,
    block_size,
    stage_words,
    PHASE: tl.constexpr,
    STAGED: tl.constexpr,  # phase 0 only: whether any move is staged (else its staging store is compiled out)
    TOK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN: tl.constexpr,  # every base, stride and row length is a multiple of ALIGN words (vector width)
):
    desc = pools + tl.program_id(1) * 7
    base = tl.load(desc)
    block_stride = tl.load(desc + 1)
    slot_stride = tl.load(desc + 2)
    row_stride = tl.multiple_of(tl.load(desc + 3), ALIGN)
    rows = tl.load(desc + 4).to(tl.int32)
    row_words = tl.multiple_of(tl.load(desc + 5).to(tl.int32), ALIGN)
    stage_off = tl.load(desc + 6)
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)
    if PHASE == 0:
        valid = t < n_direct + n_staged
        i = t
    else:
        valid = t < n_staged
        i = t + n_direct
    d = tl.load(dst + i, mask=valid, other=0).to(tl.int64)
    at_dst = tl.multiple_of(base + (d // block_size) * block_stride + (d % block_size) * slot_stride, ALIGN)
    at_stage = tl.multiple_of((i - n_direct).to(tl.int64) * stage_words + stage_off, ALIGN)
    if PHASE == 0:
        s = tl.load(src + i, mask=valid, other=0).to(tl.int64)
        at_src = tl.multiple_of(base + (s // block_size) * block_stride + (s % block_size) * slot_stride, ALIGN)
        direct = valid & (i < n_direct)
        for r in range(0, rows):
            for w0 in range(0, row_words, BLOCK_W):
                cols = w0 + tl.arange(0, BLOCK_W)
                inrow = (cols < row_words)[None, :]
                x = tl.load(words + (at_src + r * row_stride)[:, None] + cols[None, :], mask=valid[:, None] & inrow)
                tl.store(words + (at_dst + r * row_stride)[:, None] + cols[None, :], x, mask=direct[:, None] & inrow)
                if STAGED:
                    staged = valid & (i >= n_direct)
                    to = stage + (at_stage + r * row_words)[:, None] + cols[None, :]
                    tl.store(to, x, mask=staged[:, None] & inrow)
    else:
        for r in range(0, rows):
            for w0 in range(0, row_words, BLOCK_W):
                cols = w0 + tl.arange(0, BLOCK_W)
                inrow = (cols < row_words)[None, :]
                x = tl.load(stage + (at_stage + r * row_words)[:, None] + cols[None, :], mask=valid[:, None] & inrow)
                tl.store(words + (at_dst + r * row_stride)[:, None] + cols[None, :], x, mask=valid[:, None] & inrow)


@functools.cache
def _kernels():
    from triton.runtime.interpreter import InterpretedFunction

    # the move counts change every step: one compiled kernel for all of them, not one more for a count of 1
    counts = ["n_direct", "n_staged"]
    return {"cuda": triton.jit(_move_rows, do_not_specialize=counts), "cpu": InterpretedFunction(_move_rows)}


def launch(
    device_type: str,
    words,
    pools,
    src,
    dst,
    stage,
    n_direct: int,
    n_staged: int,
    block_size: int,
    stage_words: int,
    num_pools: int,
    phase: int,
    geometry: tuple[int, int, int],
) -> None:
    """One launch over ``num_pools`` pools: phase 0 (``n_direct + n_staged`` moves) or phase 1 (``n_staged``).
    ``geometry`` = (TOK, BLOCK_W, ALIGN) from ``tile``. Enqueued on the current stream; never synchronises."""
    n = n_direct + n_staged if phase == 0 else n_staged
    if n == 0:
        return
    tok, block_w, align = geometry
    kernel = _kernels()["cpu" if device_type == "cpu" else "cuda"]
    grid = (triton.cdiv(n, tok), num_pools)
    kernel[grid](
        words,
        pools,
        src,
        dst,
        stage,
        n_direct,
        n_staged,
        block_size,
        stage_words,
        PHASE=phase,
        STAGED=n_staged > 0,
        TOK=tok,
        BLOCK_W=block_w,
        ALIGN=align,
        num_warps=4,
    )


def tile(max_row_words: int, word_bytes: int, align: int, max_tok: int = 64) -> tuple[int, int, int]:
    """(TOK, BLOCK_W, ALIGN): a tile of TOK moves x BLOCK_W words holds about 8 KB, enough bytes in flight per
    program for a memory-bound copy; BLOCK_W covers a row (up to 1 KB) in one pass."""
    block_w = min(triton.next_power_of_2(max(max_row_words, 1)), max(1, 1024 // word_bytes))
    tok = max(1, min(max_tok, (8192 // word_bytes) // block_w))
    return tok, block_w, min(align, block_w)


def pool_rows(view: torch.Tensor) -> tuple[int, int, int, int, int]:
    """A view indexed [block, offset, ...] as token rows: (block, slot, row strides, rows, row length), in
    elements. Raises ValueError when a token's elements are not rows of contiguous elements."""
    if view.dim() == 2:
        return view.stride(0), view.stride(1), 0, 1, 1
    if view.dim() == 3 and (view.stride(2) == 1 or view.shape[2] == 1):
        return view.stride(0), view.stride(1), 0, 1, view.shape[2]
    if view.dim() == 4 and (view.stride(3) == 1 or view.shape[3] == 1):
        return view.stride(0), view.stride(1), view.stride(2), view.shape[2], view.shape[3]
    raise ValueError(f"a view of shape {tuple(view.shape)}, strides {view.stride()} has no contiguous token rows")


class Launch:
    """One group's launch: its pools as a device table, the word type, the tile, the event it records."""

    def __init__(self, views: list[torch.Tensor], device: torch.device, event: int) -> None:
        base = min(views, key=lambda v: v.data_ptr())
        rows = []
        for v in views:
            block, slot, row, n_rows, length = pool_rows(v)
            es = v.element_size()
            rows.append([v.data_ptr() - base.data_ptr(), block * es, slot * es, row * es, n_rows, length * es])
        nbytes = [x for r in rows for x in (r[0], r[1], r[2], r[3], r[5])] + [base.data_ptr()]
        self.word = next(w for w in (8, 4, 2, 1) if all(x % w == 0 for x in nbytes))
        table, offset = [], 0
        for r in rows:
            words = [x // self.word for x in (r[0], r[1], r[2], r[3])]
            table.append([*words, r[4], r[5] // self.word, offset])
            offset += r[4] * r[5] // self.word
        self.stage_words = offset  # words of one staged token (every pool's rows)
        self.token_bytes = offset * self.word
        self.num_pools = len(views)
        self.pools = torch.tensor(table, dtype=torch.int64).to(device)
        # the pools' memory seen as words from the lowest address (a one-word view; the kernel reads past it)
        n = -(-self.word // base.element_size())
        self.words = base.as_strided((n,), (1,)).view(torch.uint8)[: self.word].view(WORDS[self.word])
        g = math.gcd(*[x for t in table for x in (*t[:4], t[5], t[6])], offset)
        align = g & -g if g else 1  # the largest power of two dividing every offset: the vector width
        self.geometry = tile(max(t[5] for t in table), self.word, min(align, max(1, 16 // self.word)))
        self.event = event
