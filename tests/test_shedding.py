"""Pressure mode's shedding plan (vtoken/core/shedding.py) against a brute force: the shortfall covered (as far as the
budgets allow) with the fewest tokens, never below a request's budget, ties in the documented order; and on the real
compactor (tests/kvsim.py), every request at or above its budget and the pool's shortfall covered."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvsim import KVSim

from vtoken.core.phase import Phase
from vtoken.core.policies import make_policy
from vtoken.core.shedding import (
    Holder,
    admissible,
    blocks_given,
    plan_sheds,
    plan_sheds_above,
    reserved_blocks,
    tokens_for,
)

BS = 4


def gained(h: Holder, tokens: int) -> int:
    """Blocks ``h`` gives back by shedding ``tokens``: what it would hold, less what it holds after packing."""
    return h.holds - -(-(h.writing_len - tokens) // BS) if tokens else 0


def brute(holders: list[Holder], shortfall: int) -> tuple[int, int]:
    """(blocks given back, tokens) of the best plan: the most blocks up to the shortfall, then the fewest tokens."""
    options = [[0] + [tokens_for(h, g, BS) for g in range(1, h.holds + 1) if tokens_for(h, g, BS) <= h.most]
               for h in holders]  # fmt: skip
    best = None
    for combo in itertools.product(*options):
        blocks = min(sum(gained(h, c) for h, c in zip(holders, combo)), shortfall)
        key = (-blocks, sum(combo))
        best = key if best is None or key < best else best
    return -best[0], best[1]


holder = st.builds(
    lambda n, w, extra, most, reading, i: Holder(n + w, -(-(n + w) // BS) + extra, most, reading, f"r{i}"),
    n=st.integers(1, 40),
    w=st.integers(0, 9),
    extra=st.sampled_from([0, 0, 0, 1]),  # now and then a block held beyond what the next forward needs
    most=st.integers(0, 30),
    reading=st.booleans(),
    i=st.integers(0, 99),
)


@settings(max_examples=300, deadline=None)
@given(holders=st.lists(holder, min_size=1, max_size=4), shortfall=st.integers(1, 12))
def test_the_plan_covers_the_shortfall_with_the_fewest_tokens(holders, shortfall):
    plan = plan_sheds(holders, shortfall, BS)
    assert all(0 <= c <= h.most for h, c in zip(holders, plan)), "never below a request's budget"
    blocks = min(sum(gained(h, c) for h, c in zip(holders, plan)), shortfall)
    want_blocks, want_tokens = brute(holders, shortfall)
    assert blocks == want_blocks, "covered as far as the budgets allow"
    if holders and all(h.holds == -(-h.writing_len // BS) for h in holders):  # no spare blocks: exactly optimal
        assert sum(plan) == want_tokens, (plan, want_tokens)


def test_nothing_short_nothing_shed():
    assert plan_sheds([Holder(30, 8, 20, False, "a")], 0, BS) == [0]


def test_ties_go_to_requests_that_read_their_prompt_then_to_the_one_most_above_its_budget():
    reading = Holder(32, 8, 20, True, "a")  # full last blocks: every block costs 4 tokens
    decoding = Holder(32, 8, 20, False, "b")
    richer = Holder(32, 8, 28, False, "c")
    assert plan_sheds([reading, decoding], 1, BS) == [0, 4]
    assert plan_sheds([decoding, richer], 1, BS) == [0, 4]
    assert plan_sheds([Holder(33, 9, 20, True, "a"), decoding], 1, BS) == [1, 0]  # one token frees a block: cheapest


def test_a_nearly_empty_block_goes_before_a_full_one():
    plan = plan_sheds([Holder(40, 10, 30, False, "a"), Holder(41, 11, 30, False, "b")], 2, BS)
    assert plan == [4, 1] or plan == [0, 5]  # 5 tokens for two blocks either way, never 8
    assert sum(plan) == 5


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(8, 60), min_size=2, max_size=4), waiting=st.integers(1, 30), seed=st.integers(0, 99)
)
@example(prompts=[21, 25, 33, 33], waiting=30, seed=0)  # no shortfall: a fresh clone's CI run once found it
def test_on_the_compactor_every_request_stays_at_or_above_its_budget(prompts, waiting, seed):
    sim = KVSim(num_blocks=64, block_size=BS, seed=seed)
    policy = make_policy("random", budget=0.25, sink=1, recent=2, seed=seed)
    for i, n in enumerate(prompts):
        sim.add(f"r{i}", prompt=n, policy=policy, pressure=True)
    sim.step({f"r{i}": n for i, n in enumerate(prompts)})
    for _ in range(3):
        before = sim.pool.get_num_free_blocks()
        sim.step({rid: 1 for rid in sim.reqs}, waiting=[waiting * BS])
        for st_ in sim.core.states.values():
            assert st_.phase is Phase.KEEPING
            assert st_.table.num_live >= st_.keep(st_.table.num_logical), "below its budget"
        assert sim.pool.get_num_free_blocks() >= 0 and before >= 0
        sim.check()
    shed = [st_ for st_ in sim.core.states.values() if st_.record.shed_at >= 0]
    # The pool was short by the last step at the latest if the prompts' blocks after their three decode tokens and
    # the waiting request's first chunk exceed it: then someone gave tokens back. (A request's decode token needs a
    # new block only when its last block is full: counting one per request and step claimed a shortfall where
    # there was none, e.g. prompts [21, 25, 33, 33], waiting 30.)
    if sum(-(-(n + 3) // BS) for n in prompts) + waiting > 64:
        assert shed


def test_with_no_shortfall_nothing_is_evicted():
    sim = KVSim(num_blocks=64, block_size=BS)
    sim.add("a", prompt=30, policy=make_policy("random", budget=0.25, sink=0, recent=0), pressure=True)
    sim.step({"a": 30})
    for _ in range(5):
        sim.step({"a": 1}, waiting=[8])
    st_ = sim.core.states["a"]
    assert st_.table.num_live == st_.table.num_logical == 34 and sim.core.totals.tokens_evicted == 0
    assert np.array_equal(st_.table.live_logical(), np.arange(34))


# ------------------------------------------------------------------ pressure_floor
@settings(max_examples=300, deadline=None)
@given(
    holders=st.lists(holder, min_size=1, max_size=4),
    floors=st.lists(st.integers(0, 30), min_size=4, max_size=4),
    shortfall=st.integers(1, 12),
)
def test_with_a_floor_sheds_go_below_it_only_when_what_is_above_cannot_cover_the_shortfall(holders, floors, shortfall):
    above = [min(a, h.most) for h, a in zip(holders, floors)]
    plan = plan_sheds_above(holders, above, shortfall, BS)
    assert all(0 <= c <= h.most for h, c in zip(holders, plan)), "never below a request's budget"
    blocks = min(sum(gained(h, c) for h, c in zip(holders, plan)), shortfall)
    assert blocks == brute(holders, shortfall)[0], "covered as far as the budgets allow, as without a floor"
    capped = [h._replace(most=a) for h, a in zip(holders, above)]
    if brute(capped, shortfall)[0] >= shortfall:  # what lies above the floors covers it: nobody goes below
        assert all(c <= a for c, a in zip(plan, above)), (plan, above)
        assert sum(plan) == sum(plan_sheds(capped, shortfall, BS))
    assert [blocks_given(h, c, BS) for h, c in zip(holders, plan)] == [gained(h, c) for h, c in zip(holders, plan)]


def test_admission_stops_at_the_first_waiting_request_that_does_not_fit_at_its_floor():
    assert admissible(0, [10, 10, 10], 25) == 2
    assert admissible(20, [10, 1], 25) == 0, "first come, first served: the small one does not jump the queue"
    assert admissible(0, [40], 25) == 1, "with nothing running the first is admitted whatever it reserves"
    assert admissible(5, [40], 25) == 0
    assert reserved_blocks(100, 10, 0.5, 8, BS) == 15  # 50 tokens at the floor and 8 being written: 58 -> 15 blocks
    assert reserved_blocks(100, 60, 0.5, 1, BS) == 16  # a budget above the floor wins


def test_on_the_compactor_a_floor_keeps_running_requests_above_it_and_holds_back_who_does_not_fit():
    below = {}
    for floor in (0.5, 0.0):  # 0.0: the negative control, the same shortfall without a floor
        sim = KVSim(num_blocks=64, block_size=BS, floor=floor)
        policy = make_policy("random", budget=0.25, sink=1, recent=2)
        for i in range(3):
            sim.add(f"r{i}", prompt=60, policy=policy, pressure=True)
        sim.step({f"r{i}": 60 for i in range(3)})  # 45 of 64 blocks
        sim.step({rid: 1 for rid in sim.reqs}, waiting=[8 * BS])  # short by 45 + 8 - 64 < 0: nothing shed yet
        if floor:
            # At the floor each running request holds 30 of its 60 tokens and the one it writes: 8 blocks, 24 for
            # the three; a waiting request of 40 tokens reserves 20 and 1: 6 blocks; one chunk of 8 tokens (2
            # blocks) is set aside for all. 24 + 6 * 6 <= 64 - 2 < 24 + 7 * 6.
            assert sim.core.admissible([(40, 10, 0.5)] * 9, 0, 8) == 6  # (tables know the prompts once a step began)
            assert sim.core.admissible([(40, 10, 0.5)] * 9, 6, 8) == 5, "the watermark is set aside too"
            assert sim.core.admissible([(40, 10, 0.0)] * 9, 0, 8) == 9, "in always mode: its budget, 3 blocks"
            assert sim.core.admissible([(40, 10, 0.0)] * 20, 0, 8) == 12
        else:
            assert sim.core.admissible([(40, 10, 0.0)] * 9, 0, 8) is None, "no floor: vLLM admits as it would"
        sim.step({rid: 1 for rid in sim.reqs}, waiting=[12 * BS] * 3)  # short by 48 + 36 - 64 = 20 blocks
        assert sim.core.totals.tokens_evicted > 0
        assert all(st_.table.num_live >= st_.keep(st_.table.num_logical) for st_ in sim.core.states.values())
        below[floor] = sum(st_.table.num_live < -(-st_.table.num_logical // 2) for st_ in sim.core.states.values())
        sim.check()
    assert below == {0.5: 0, 0.0: 1}, below  # what lies above the floors covers the 20 blocks


def test_a_request_s_own_floor_is_kept_by_admission_and_sheds_whatever_the_others_ask():
    """``pressure_floor`` per request (``request_args(pressure_floor=...)``): on an engine without a floor, a
    request that asks for one is reserved at it by every admission while it runs and sheds below it last; the
    others shed down to their budgets first. Negative control: the same shortfall with no request asking."""
    below, shed = {}, {}
    for asks in (0.5, None):
        sim = KVSim(num_blocks=64, block_size=BS)  # the engine's floor: 0
        policy = make_policy("random", budget=0.25, sink=1, recent=2)
        sim.add("keeper", prompt=60, policy=policy, pressure=True, floor=asks)
        for i in range(2):
            sim.add(f"r{i}", prompt=60, policy=policy, pressure=True)
        sim.step({rid: 60 for rid in sim.reqs})  # 45 of 64 blocks
        sim.step({rid: 1 for rid in sim.reqs}, waiting=[8 * BS])  # nothing short yet
        if asks:
            # The keeper reserves 30 + 1 tokens (8 blocks), the others their budgets, 15 + 1 (4 blocks each): 16;
            # one chunk of 8 tokens (2 blocks) is set aside. A waiting request with its own floor of 0.5 reserves
            # 6 blocks (20 + 1 tokens), one without 3 (10 + 1): first come, first served.
            assert sim.core.admissible([(40, 10, 0.5)] * 9, 0, 8) == 7  # 16 + 7 * 6 <= 62 < 16 + 8 * 6
            assert sim.core.admissible([(40, 10, 0.0)] * 20, 0, 8) == 15  # 16 + 15 * 3 <= 62
            assert sim.core.admissible([(40, 10, 0.0), (40, 10, 0.5)] * 7, 0, 8) == 10  # 16 + 5 * (3 + 6) <= 62 < 64
        else:
            assert sim.core.admissible([(40, 10, 0.0)] * 9, 0, 8) is None, "no floor anywhere: vLLM admits as it would"
            assert sim.core.admissible([(40, 10, 0.5)] + [(40, 10, 0.0)] * 8, 0, 8) is not None, "one waiting asks"
        sim.step({rid: 1 for rid in sim.reqs}, waiting=[12 * BS] * 3)  # short by 48 + 36 - 64 = 20 blocks
        st_ = sim.core.states["keeper"]
        below[asks] = st_.table.num_live < -(-st_.table.num_logical // 2)
        assert sim.core.floored() == bool(asks)
        shed[asks] = sim.core.totals.tokens_evicted
        assert all(s.table.num_live >= s.keep(s.table.num_logical) for s in sim.core.states.values())
        sim.check()
        sim.preempt("keeper", policy=policy, pressure=True, floor=asks)  # resumed with its own floor again
        assert sim.core.states["keeper"].floor == (asks or 0.0) and sim.core.floored() == bool(asks)
        sim.finish("keeper")
        assert not sim.core.floored()
        sim.check()
    assert shed[0.5] > 0 and shed[None] > 0, shed
    # Without its floor the keeper sheds first (ties go to the request id) down to its budget; with it, the others'
    # tokens above their budgets cover what its own 30 above the floor do not.
    assert below == {0.5: False, None: True}, below


def test_an_engine_floor_admits_always_mode_requests_at_their_budgets():
    """An engine with a pressure_floor caps admission even when every request keeps to its budget (``evict:
    "always"``): each reserves its budget (found in review: the per-request floor had made this cap vanish when no
    request in pressure mode held a floor). Negative control: without an engine floor vLLM admits as it would."""
    for floor in (0.5, 0.0):
        sim = KVSim(num_blocks=64, block_size=BS, floor=floor)
        policy = make_policy("random", budget=0.25, sink=1, recent=2)
        for i in range(3):
            sim.add(f"r{i}", prompt=60, policy=policy)  # always mode
        sim.step({rid: 60 for rid in sim.reqs})
        # Each running request reserves its budget, 15 of 60 tokens and 1 written: 4 blocks, 12 for the three; a
        # waiting one of 40 tokens 3 (10 + 1); one chunk of 8 tokens (2 blocks) aside: 12 + 16 * 3 <= 62 < 12 + 51.
        got = sim.core.admissible([(40, 10, 0.0)] * 30, 0, 8)
        assert got == (16 if floor else None), (floor, got)
