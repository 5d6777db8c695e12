"""The kept-tokens rule (vtoken/core/budget.py), once for the compactor, placement and the fleet simulator: its values
on hand-made cases, and placement's estimate of a request's peak against the blocks the real compactor holds
(tests/kvsim.py) while it reads a prompt in chunks and decodes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvsim import KVSim

from cluster.sim.replica import Limits
from vtoken.core.budget import kept_tokens, live_tokens, peak_blocks, target_tokens
from vtoken.core.policies import make_policy


def test_the_rule_on_hand_made_cases():
    assert target_tokens(100, 0.25) == 25 and target_tokens(3, 0.25) == 1 and target_tokens(0, 0.25) == 1
    assert target_tokens(100, 40) == 40
    assert kept_tokens(100, 0.25, 4, 16) == 25 and kept_tokens(40, 0.25, 4, 16) == 20  # sink + recent hold more
    assert kept_tokens(10, 0.25, 4, 16) == 10  # ... but never more than there is
    assert live_tokens(10, 40, 4, 16) == 10 and live_tokens(10, None, 4, 16) == 10
    assert make_policy("h2o", budget=0.25).target(100) == target_tokens(100, 0.25)


def test_the_simulator_keeps_what_the_compactor_keeps():
    lim = Limits(block_size=32, max_num_batched_tokens=512, max_num_seqs=8, budget=0.25, protected=20)
    assert [lim.live(n) for n in (0, 10, 40, 100, 1000)] == [
        live_tokens(n, 0.25, 20, 0) for n in (0, 10, 40, 100, 1000)
    ]
    assert [lim.live(n) for n in (10, 80, 1000)] == [10, 20, 250]


def measured_peak(prompt, max_tokens, bs, budget, sink, recent, chunk, prefill_evict, interval=1) -> int:
    """The most blocks a request held during one of its forwards, on the real compactor."""
    sim = KVSim(num_blocks=4096, block_size=bs)
    policy = make_policy("random", budget=budget, sink=sink, recent=recent, interval=interval)
    sim.add("r", prompt=prompt, policy=policy, prefill_evict=prefill_evict)
    left = prompt
    while left:
        n = min(left, chunk or prompt)
        sim.step({"r": n})
        left -= n
    for _ in range(max_tokens - 1):
        sim.step({"r": 1})
    sim.check()
    return sim.core.states["r"].record.peak_retained


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 400),
    max_tokens=st.integers(1, 80),
    bs=st.sampled_from([4, 16]),
    budget=st.sampled_from([0.1, 0.25, 0.5, 24]),
    sink=st.integers(0, 4),
    recent=st.integers(0, 16),
    chunk=st.sampled_from([None, 16, 64]),
    prefill_evict=st.booleans(),
    interval=st.sampled_from([1, 0, 3]),
)
def test_placement_reserves_what_the_request_really_holds_at_most(
    prompt, max_tokens, bs, budget, sink, recent, chunk, prefill_evict, interval
):
    """Never less than the real peak (a replica that takes the request can hold it), and at most two blocks more
    (the bound's slack: the block being filled, and the decisions that come in batches of ``interval``). Before the
    rule was shared, placement assumed the whole prompt held, so a 400-token prompt read in chunks of 16 at 10% was
    estimated at three times its real peak."""
    real = measured_peak(prompt, max_tokens, bs, budget, sink, recent, chunk, prefill_evict, interval)
    est = peak_blocks(prompt, max_tokens, bs, budget, sink, recent, chunk, prefill_evict, interval or bs)
    assert real <= est <= real + 2, (real, est)


def test_without_a_budget_the_whole_context():
    assert peak_blocks(100, 60, 32) == -(-160 // 32) + 1
    assert peak_blocks(0, 0, 32) == 1
