"""The fused mover (vtoken/kv/fused_mover.py) against the per-move reference, with negative controls.

On CPU the Triton kernel runs under Triton's interpreter: the mover picks it for CPU tensors, so no
TRITON_INTERPRET switch is set and the rest of the process keeps its compiled Triton kernels. The CUDA
tests (marked gpu) run the compiled kernel, the per-layer waits and their planted missing wait.
"""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from vtoken.core.move_batch import MoveBatch  # noqa: E402
from vtoken.kv.fused_mover import FusedMover, group_sizes  # noqa: E402
from vtoken.kv.kv_layout import LAYOUTS  # noqa: E402
from vtoken.kv.move_kernel import pool_rows  # noqa: E402
from vtoken.kv.mover import ReferenceMover  # noqa: E402

BS, NB, H, HS, LAYERS = 4, 12, 2, 8, 5  # 5 layers: groups of 1, 2, 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]  # uint8: an fp8 cache's storage (issue 58)


def state(dtype, device="cpu", seed=0):
    """KV caches in the FlashAttention layout and the scorer's two per-slot tensors (fp32 sums, int64 bits)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # every byte value, fp8's NaN codes included: a move copies bytes, never values
        kv = [torch.randint(0, 256, (NB, H, BS, 2 * HS), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
    else:
        kv = [torch.randn(NB, H, BS, 2 * HS, generator=g).to(dtype) for _ in range(LAYERS)]
    extra = [torch.randn(NB * BS, generator=g), torch.randint(-(2**62), 2**62, (NB * BS,), generator=g)]
    return [t.to(device) for t in kv], [t.to(device) for t in extra]


def random_batch(seed: int) -> MoveBatch:
    """Distinct destinations; sources drawn with replacement, so some slots are both read and written."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, NB * BS // 2))
    return MoveBatch(rng.integers(0, NB * BS, n).astype(np.int64), rng.permutation(NB * BS)[:n].astype(np.int64))


def equals_reference(mover, batch, kv, extra) -> bool:
    """Apply ``batch`` with ``mover`` and with the per-move reference (on copies); do they agree everywhere?"""
    ref = [t.cpu().clone() for t in kv + extra]
    mover.apply(kv, batch, extra)
    if kv[0].is_cuda:
        mover.wait()
        torch.cuda.synchronize()
    ReferenceMover(BS, "flash").apply(ref[: len(kv)], batch, ref[len(kv) :])
    return all(torch.equal(a.cpu(), b) for a, b in zip(kv + extra, ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tok", [64, 4], ids=["one-tile", "tiles-of-4"])
def test_fused_kernel_equals_reference_under_the_interpreter(dtype, seed, tok):
    batch = random_batch(seed)
    mover = FusedMover(BS, "flash", "cpu")
    mover._MAX_TOK = tok
    assert equals_reference(mover, batch, *state(dtype, seed=seed))
    assert mover.bytes_moved == int((batch.src != batch.dst).sum()) * mover.token_bytes


@pytest.mark.parametrize(
    "src,dst",
    [([0, 5], [5, 0]), ([1, 2, 3], [2, 3, 1]), ([7, 8, 9], [8, 9, 10]), ([4, 4, 4], [4, 11, 30])],
    ids=["swap", "cycle", "chain", "self-and-fanout"],
)
def test_cycles_chains_and_self_moves(src, dst):
    batch = MoveBatch(np.array(src, np.int64), np.array(dst, np.int64))
    assert equals_reference(FusedMover(BS, "flash", "cpu"), batch, *state(torch.bfloat16))


def test_unaligned_caches_move_in_narrower_words():
    """Caches at an odd bf16 offset inside one allocation: the launch falls back to 2-byte words."""
    size = NB * H * BS * 2 * HS
    whole = torch.randn(LAYERS * size + 1).to(torch.bfloat16)
    kv = [whole[1 + i * size : 1 + (i + 1) * size].view(NB, H, BS, 2 * HS) for i in range(LAYERS)]
    mover = FusedMover(BS, "flash", "cpu")
    assert equals_reference(mover, random_batch(7), kv, [])
    assert {x.word for x in mover._launches} == {2}


def reuse_batch() -> MoveBatch:
    """Request A packs its tail block 2 (slots 8, 9) into holes of its block 0 (slots 1, 3); block 2 is freed
    and handed to request B, whose tokens in block 5 (slots 20-23) move into it in the same step. B's moves
    come first, so a mover that writes before it reads has overwritten slots 8 and 9 by the time A reads them."""
    return MoveBatch(np.array([20, 21, 22, 23, 8, 9], np.int64), np.array([8, 9, 10, 11, 1, 3], np.int64))


def test_a_block_freed_and_reused_in_the_same_step():
    kv, extra = state(torch.float16)
    before = [t.clone() for t in kv + extra]
    mover = FusedMover(BS, "flash", "cpu")
    mover.apply(kv, reuse_batch(), extra)
    assert mover.staged == 2  # slots 8 and 9 are read by A and written by B
    for t, old in zip(kv + extra, before):
        layout = "flash" if t.dim() == 4 else "slots"
        v, o = LAYOUTS[layout](t, BS)[0], LAYOUTS[layout](old, BS)[0]  # [block, offset, ...]
        assert torch.equal(v[0, 1], o[2, 0]) and torch.equal(v[0, 3], o[2, 1])  # A's tokens, read before B wrote
        assert torch.equal(v[2], o[5])  # B's block
        assert torch.equal(v[0, 0], o[0, 0]) and torch.equal(v[1], o[1])  # untouched


class WritesBeforeReading(FusedMover):
    """Planted bug: every move goes straight to its destination in one launch, one move per program, in batch
    order (the order the interpreter runs programs in): no staging of destinations that are also sources."""

    _MAX_TOK = 1

    @staticmethod
    def _hazards(src, dst):
        return np.zeros(src.shape, bool)


def test_negative_control_writing_before_reading_corrupts_the_reused_block():
    assert not equals_reference(WritesBeforeReading(BS, "flash", "cpu"), reuse_batch(), *state(torch.float32))
    real = FusedMover(BS, "flash", "cpu")
    real._MAX_TOK = 1  # the same tiles, with the hazard split
    assert equals_reference(real, reuse_batch(), *state(torch.float32))


def test_launches_per_step_and_a_step_allocates_nothing():
    kv, extra = state(torch.bfloat16)
    mover = FusedMover(BS, "flash", "cpu")
    mover.apply(kv, MoveBatch(np.array([1, 2]), np.array([30, 31])), extra)
    assert mover.launches == 1 + len(group_sizes(LAYERS)) == 4  # per-slot tensors, then groups of 1, 2, 2 layers
    mover.apply(kv, reuse_batch(), extra)
    assert mover.launches == 4 + 2 * 4  # staged moves: a second launch per group

    def buffers():
        return [mover._index.data_ptr(), mover._stage.data_ptr(), *(x.pools.data_ptr() for x in mover._launches)]

    first = buffers()
    for seed in range(3):
        assert equals_reference(mover, random_batch(seed), kv, extra)
    assert buffers() == first


def test_staging_grows_once_past_its_size():
    kv, extra = state(torch.float32)
    mover = FusedMover(BS, "flash", "cpu")
    mover.bind(kv, extra)
    mover._grow_stage(4)
    n = NB * BS // 2
    cycle = MoveBatch(np.arange(n, dtype=np.int64), np.roll(np.arange(n, dtype=np.int64), 1))  # all staged
    assert equals_reference(mover, cycle, kv, extra)
    assert mover.staged == n and mover._stage_tokens >= n


def test_group_sizes_and_layer_events():
    assert group_sizes(1) == [1] and group_sizes(5) == [1, 2, 2]
    assert group_sizes(30) == [1, 2, 4, 8, 15] and group_sizes(32) == [1, 2, 4, 8, 17]
    assert all(sum(group_sizes(n)) == n for n in range(1, 200))
    kv, extra = state(torch.float32)
    mover = FusedMover(BS, "flash", "cpu")
    mover.bind(kv, extra)
    assert mover.layer_event == [1, 2, 2, 3, 3]  # event 0 is the per-slot tensors'
    assert [mover.layer_of(t) for t in kv] == list(range(LAYERS)) and mover.layer_of(extra[0]) is None


def test_layouts_without_token_rows_and_bad_slots_are_refused():
    cpu_kv = torch.zeros(NB, H, BS * 2 * HS)
    with pytest.raises(ValueError, match="no contiguous token rows"):
        pool_rows(LAYOUTS["cpu"](cpu_kv, BS)[0])  # K stored transposed: a token's K is strided
    with pytest.raises(ValueError, match="slots must lie"):
        FusedMover(BS, "flash", "cpu").apply(state(torch.float32)[0], MoveBatch(np.array([0]), np.array([NB * BS])))


def hopper_ptx(phase: int, staged: bool, align: int) -> str:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from vtoken.kv.move_kernel import _kernels
    except ImportError as e:
        pytest.skip(f"this Triton cannot compile ahead of time: {e}")
    ptr = {n: "*i64" for n in ("words", "pools", "stage")} | {"src": "*i32", "dst": "*i32"}
    ints = {n: "i32" for n in ("n_direct", "n_staged", "block_size", "stage_words")}
    consts = {"PHASE": phase, "STAGED": staged, "TOK": 32, "BLOCK_W": 32, "ALIGN": align}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 7)}
    src = ASTSource(_kernels()["cuda"], {**ptr, **ints, **dict.fromkeys(consts, "constexpr")}, consts, aligned)
    try:
        return triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False}
        ).asm["ptx"]
    except RuntimeError as e:  # no ptxas in this Triton build
        pytest.skip(f"no CUDA toolchain in this Triton: {e}")


@pytest.mark.parametrize("phase,staged", [(0, False), (0, True), (1, True)])
def test_kernel_compiles_for_hopper_and_copies_16_byte_vectors(phase, staged):
    """No GPU needed: Triton compiles the kernel for sm_90 (the H200) ahead of time. A KV launch (8-byte words,
    rows of 32 words, bases aligned to 2 words) must load and store 16 bytes per instruction, as a copy does."""
    ptx = hopper_ptx(phase, staged, align=2)
    assert "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx


def test_negative_control_without_the_alignment_hint_the_copy_is_8_bytes_wide():
    ptx = hopper_ptx(0, False, align=1)
    assert "st.global.b64" in ptx and "st.global.v2.b64" not in ptx


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_fused_mover_equals_reference(dtype):
    mover = FusedMover(BS, "flash", "cuda")
    for seed in range(4):
        assert equals_reference(mover, random_batch(seed), *state(dtype, "cuda", seed))
    assert equals_reference(mover, reuse_batch(), *state(dtype, "cuda"))


@pytest.mark.gpu
def test_cuda_apply_never_synchronises_the_host():
    kv, extra = state(torch.bfloat16, "cuda")
    mover = FusedMover(BS, "flash", "cuda")
    mover.apply(kv, random_batch(0), extra)  # binds (allocates) and compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for seed in range(1, 6):
            mover.apply(kv, random_batch(seed), extra)
            mover.wait_unhooked()
            mover.wait_layer(LAYERS - 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert mover.host_waits == 0


def _late_moves_read_by_layers(skip_layer: int | None) -> list[bool]:
    """The moves start 50 ms late on the side stream; each layer's reader waits for its own group (except
    ``skip_layer``: the planted missing wait) and copies the moved slot. Which layers read the moved value?"""
    kv = [torch.zeros(NB, H, BS, 2 * HS, device="cuda") for _ in range(LAYERS)]
    for i, t in enumerate(kv):
        t[0].fill_(i + 1)  # slot 0 of every layer holds its value; slot NB * BS - 1 is 0
    mover = FusedMover(BS, "flash", "cuda")
    mover.bind(kv)
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(100_000_000)  # ~50 ms: without its wait a reader runs long before the moves
    mover.apply(kv, MoveBatch(np.array([0]), np.array([NB * BS - 1])))
    seen = []
    for i in range(LAYERS):
        if i != skip_layer:
            mover.wait_layer(i)
        seen.append(kv[i][-1, :, BS - 1].clone())  # on the compute stream
    torch.cuda.synchronize()
    return [bool((s == i + 1).all()) for i, s in enumerate(seen)]


@pytest.mark.gpu
def test_cuda_per_layer_waits_and_a_planted_missing_wait_is_caught():
    assert _late_moves_read_by_layers(None) == [True] * LAYERS
    seen = _late_moves_read_by_layers(skip_layer=0)  # layer 0 is a group of its own: nothing else waits for it
    assert seen[0] is False and seen[1:] == [True] * (LAYERS - 1)
