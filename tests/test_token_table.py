import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vtoken.core.token_table import TokenTable, TokenTableError


def test_append_kill_moves_roundtrip():
    t = TokenTable(block_size=4, num_tokens=10)
    assert (t.num_logical, t.num_live, t.physical_len, t.num_blocks) == (10, 10, 10, 3)
    assert t.kill(np.array([1, 4, 5])).tolist() == [1, 4, 5]
    assert t.physical_live_mask().tolist() == [1, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    t.apply_moves(np.array([7, 8, 9]), np.array([1, 4, 5]), physical_len=7)
    assert t.slot_of.tolist() == [0, -1, 2, 3, -1, -1, 6, 1, 4, 5]
    assert t.logical_of().tolist() == [0, 7, 2, 3, 8, 9, 6]
    assert t.num_blocks == 2
    assert t.append(2).tolist() == [7, 8]
    t.check_integrity()


def test_errors_are_clear():
    t = TokenTable(block_size=4, num_tokens=4)
    t.kill(np.array([0]))
    with pytest.raises(TokenTableError, match="already-evicted"):
        t.kill(np.array([0]))
    with pytest.raises(TokenTableError, match="out of range"):
        t.kill(np.array([9]))
    with pytest.raises(TokenTableError, match="empty slots"):
        t.apply_moves(np.array([0]), np.array([1]))
    with pytest.raises(TokenTableError, match="beyond physical_len"):
        t.apply_moves(np.array([]), np.array([]), physical_len=2)
    with pytest.raises(TokenTableError, match="block_size"):
        TokenTable(block_size=0)


def test_slot_of_is_read_only():
    t = TokenTable(block_size=4, num_tokens=3)
    with pytest.raises(ValueError):
        t.slot_of[0] = 5


@pytest.mark.parametrize("n", [16 * 1024, 128 * 1024])
def test_metadata_at_most_8_bytes_per_token(n):
    t = TokenTable(block_size=16)
    for _ in range(n // 1024):
        t.append(1024)
    assert t.nbytes / n <= 8.0
    assert t.nbytes == 4 * n + 4 * n // 16  # int32 per logical token and per logical block, grown in blocks


def test_preemption_reset():
    t = TokenTable(block_size=4, num_tokens=9)
    t.kill(np.arange(3))
    t.reset()
    assert (t.num_logical, t.num_live, t.physical_len, t.nbytes) == (0, 0, 0, 0)
    t.check_integrity()


@given(
    st.lists(
        st.tuples(st.sampled_from(["append", "kill"]), st.integers(1, 40), st.integers(0, 2**32 - 1)), max_size=40
    ),
    st.sampled_from([1, 4, 16]),
)
def test_random_trace_keeps_invariants(ops, bs):
    t = TokenTable(block_size=bs)
    for op, n, seed in ops:
        if op == "append":
            slots = t.append(n)
            assert slots.size == n
        elif t.num_live:
            rng = np.random.default_rng(seed)
            t.kill(rng.choice(t.live_logical(), size=min(n, t.num_live), replace=False))
        t.check_integrity()
        cap = t.num_logical + bs  # capacity grows in whole blocks
        assert t.nbytes <= 4 * cap + 4 * (cap // bs + 1)


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["append", "kill"]), st.integers(0, 40), st.integers(0, 2**31)), max_size=30
    ),
    writing=st.integers(0, 70),
)
def test_naive_blocks_match_the_accounting_reference(ops, writing):
    """TokenTable.naive_blocks (O(blocks), from per-block live counts) equals naive_retained_blocks over the
    live mask with the next ``writing`` tokens appended as live (O(tokens))."""
    from vtoken.core.accounting import naive_retained_blocks

    t = TokenTable(block_size=4)
    for op, n, seed in ops:
        if op == "append":
            t.append(n)
        elif t.num_live:
            live = t.live_logical()
            t.kill(np.random.default_rng(seed).choice(live, min(n, live.size), replace=False))
        t.check_integrity()
        ref = naive_retained_blocks(np.append(t.live_mask(), np.ones(writing, bool)), 4)
        assert t.naive_blocks(writing) == ref
        assert t.naive_blocks() == naive_retained_blocks(t.live_mask(), 4)
