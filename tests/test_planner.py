"""Properties of the compaction planner, each with a planted-bug planner showing the check can fail."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vtoken.core.planner import (
    CompactionPlan,
    PlannerError,
    moves_lower_bound,
    plan_compaction,
    plan_compaction_reference,
    protected_prefix,
)


@st.composite
def layouts(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(0, 12 * bs))
    live = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    nblocks = -(-n // bs) + draw(st.integers(0, 1))
    prot = draw(st.integers(0, nblocks))
    live[: prot * bs] = True  # the engine never evicts tokens in shared blocks
    ids = draw(st.permutations(range(100, 100 + nblocks)))
    return live, list(ids), bs, prot


def check_plan(live, block_ids, bs, prot, plan: CompactionPlan):
    """Every property the issue names; raises AssertionError on the first violation."""
    base = min(prot * bs, live.size)
    src, dst = plan.src, plan.dst
    assert live[src].all() if src.size else True, "a move reads an empty slot"
    assert not live[dst].any() if dst.size else True, "a move overwrites a live token"
    after = live.copy()
    after[src] = False
    after[dst] = True
    assert after.sum() == live.sum() and np.unique(dst).size == dst.size, "two live tokens share a slot"
    assert (src >= base).all() and (dst >= base).all(), "a protected block was touched"
    n_live = int(live.sum())
    assert plan.physical_len == n_live and after[: plan.physical_len].all(), "live tokens are not packed"
    assert plan.keep_blocks == max(-(-n_live // bs), prot), "live tokens do not fill the fewest blocks"
    assert not after[plan.keep_blocks * bs :].any(), "a freed block holds a live token"
    assert plan.free_block_ids == block_ids[plan.keep_blocks :]
    assert plan.num_moves == moves_lower_bound(live, bs, prot), "more moves than the lower bound"


@given(layouts())
def test_fast_planner_satisfies_every_property(case):
    live, ids, bs, prot = case
    check_plan(live, ids, bs, prot, plan_compaction(live, ids, bs, prot))


@given(layouts())
def test_fast_planner_agrees_with_reference(case):
    live, ids, bs, prot = case
    fast = plan_compaction(live, ids, bs, prot)
    ref = plan_compaction_reference(live, ids, bs, prot)
    assert (fast.physical_len, fast.keep_blocks, fast.free_block_ids) == (
        ref.physical_len,
        ref.keep_blocks,
        ref.free_block_ids,
    )
    assert fast.num_moves <= ref.num_moves


# ---------------------------------------------------------------- negative controls: planted bugs


def _off_by_one(live, ids, bs, prot):
    p = plan_compaction(live, ids, bs, prot)
    return p._replace(physical_len=p.physical_len - 1) if p.physical_len else p._replace(physical_len=1)


def _ignores_protection(live, ids, bs, prot):
    return plan_compaction(live, ids, bs, 0)


def _forgets_last_mover(live, ids, bs, prot):
    p = plan_compaction(live, ids, bs, prot)
    return p._replace(src=p.src[:-1], dst=p.dst[:-1])


def _frees_one_block_too_many(live, ids, bs, prot):
    p = plan_compaction(live, ids, bs, prot)
    k = max(p.keep_blocks - 1, 0)
    return p._replace(keep_blocks=k, free_block_ids=ids[k:])


def _duplicate_destination(live, ids, bs, prot):
    p = plan_compaction(live, ids, bs, prot)
    return p._replace(dst=np.r_[p.dst[:1], p.dst[:-1]]) if p.num_moves > 1 else p


BUGS = {
    "off_by_one": (_off_by_one, np.array([1, 0, 1, 1, 1], bool), 0),
    "ignores_protection": (_ignores_protection, np.array([1, 0, 1, 1, 1, 1, 1, 1], bool), 1),
    "forgets_last_mover": (_forgets_last_mover, np.array([1, 0, 0, 1, 1, 1, 1, 0], bool), 0),
    "frees_too_many": (_frees_one_block_too_many, np.array([1, 1, 0, 1, 1, 1], bool), 0),
    "duplicate_destination": (_duplicate_destination, np.array([1, 0, 0, 1, 1, 1, 1, 0], bool), 0),
    "reference_moves_too_much": (plan_compaction_reference, np.array([0, 1, 1, 1, 1, 1, 1, 1], bool), 0),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_property_check_catches_planted_bug(bug):
    planner, live, prot = BUGS[bug]
    ids = list(range(10, 10 + -(-live.size // 4)))
    with pytest.raises(AssertionError):
        check_plan(live, ids, 4, prot, planner(live, ids, 4, prot))


def test_property_check_catches_bugs_on_random_layouts():
    """Over random layouts, each planted bug is caught at least once (no bug hides behind the inputs)."""
    rng = np.random.default_rng(0)
    caught = {b: 0 for b in BUGS}
    for _ in range(300):
        bs = int(rng.choice([2, 4, 8]))
        n = int(rng.integers(bs, 10 * bs))
        live = rng.random(n) < 0.5
        prot = int(rng.integers(0, 2))
        # protected tokens stay live, except that a protected block may have holes for this control
        ids = list(range(-(-n // bs)))
        for b, (planner, _, _) in BUGS.items():
            try:
                check_plan(
                    live,
                    ids,
                    bs,
                    prot if b == "ignores_protection" else 0,
                    planner(live, ids, bs, prot if b == "ignores_protection" else 0),
                )
            except AssertionError:
                caught[b] += 1
    assert all(caught.values()), caught


def test_example_from_the_module_diagram():
    live = np.array([1, 1, 1, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1], bool)
    p = plan_compaction(live, [7, 8, 9, 10], 4, num_protected=1)
    assert p.physical_len == 10 and p.keep_blocks == 3 and p.free_block_ids == [10]
    assert sorted(p.src.tolist()) == [11, 12, 14] and sorted(p.dst.tolist()) == [5, 6, 8]


def test_protected_blocks_must_be_a_prefix():
    assert protected_prefix(np.array([1, 1, 0, 0], bool)) == 2
    with pytest.raises(PlannerError, match="prefix"):
        protected_prefix(np.array([1, 0, 1], bool))
    with pytest.raises(PlannerError, match="blocks"):
        plan_compaction(np.ones(9, bool), [1, 2], 4)


def test_moves_against_lower_bound_on_a_long_random_trace():
    rng = np.random.default_rng(1)
    live = rng.random(16384) < 0.25
    p = plan_compaction(live, list(range(16384 // 16)), 16)
    assert p.num_moves == moves_lower_bound(live, 16)
    assert p.num_moves < plan_compaction_reference(live, list(range(1024)), 16).num_moves
