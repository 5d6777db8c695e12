"""Recall and re-inflation on the compactor (issue 42), driven through tests/kvsim.py with the tier's bytes
(vtoken/kv/tier.py): what a request gives up parks, a recall swaps parked winners with live losers (the live count
stays), re-inflation brings parked tokens back when the pool has room and nothing waits, a full tier frees the
oldest parked tokens first, and after every step every live token's K and V are where its TokenTable says, byte
for byte (parked ones came back intact). No engine, no vLLM."""

from __future__ import annotations

import numpy as np
from kvsim import KVSim

from vtoken.core.phase import Phase
from vtoken.core.policies import ATTN_SUM, make_policy

BS = 4


def scores(sim: KVSim, rid: str, parked: bool, rng) -> dict:
    """A window's statistics for ``rid``: random per live slot; with ``parked``, for its parked tokens too."""
    st = sim.core.states[rid]
    out = {ATTN_SUM: rng.random(len(sim.reqs[rid].blocks) * BS)}
    if parked and st.parked.size:
        out[f"parked:{ATTN_SUM}"] = rng.random(st.parked.size) + 1.0  # parked ones score higher: they come back
        out["parked:slots"] = st.parked.tier.copy()
    return out


def shed_sim():
    """Two pressure-mode decoders on a pool that runs short when a third request waits: both shed, parking."""
    sim = KVSim(num_blocks=24, block_size=BS, tier_tokens=256)
    policy = make_policy("snapkv", budget=0.25, sink=0, recent=0)
    for rid in ("a", "b"):
        sim.add(rid, prompt=32, policy=policy, pressure=True)
    sim.step({"a": 32, "b": 32})
    rng = np.random.default_rng(0)
    for rid in ("a", "b"):
        sim.core.receive_stats(rid, scores(sim, rid, False, rng))
    sim.step({"a": 1, "b": 1}, waiting=[40])  # short: both shed, and park what they shed
    sim.check()
    return sim, rng


def test_a_shed_while_decoding_parks_and_nothing_is_lost():
    sim, _ = shed_sim()
    for rid in ("a", "b"):
        st = sim.core.states[rid]
        assert st.phase is Phase.KEEPING and st.parked.size > 0
        assert not st.record.trace()["evicted_positions"], "nothing died: the tier had room"
    sim.core.check_integrity()


def test_a_recall_swaps_parked_winners_for_live_losers_and_keeps_the_count():
    sim, rng = shed_sim()
    st = sim.core.states["a"]
    live, parked = st.table.num_live, st.parked.size
    sim.core.receive_stats("a", scores(sim, "a", True, rng))
    sim.step({"a": 1, "b": 1}, waiting=[4])  # something waits (no re-inflation), the pool is not short (no shed)
    sim.check()  # the recalled tokens' K and V came back from the tier byte for byte
    assert sim.core.totals.recalls == 1 and sim.core.totals.tokens_recalled > 0
    assert st.table.num_live == live + 1  # the same count, plus the token this step's forward wrote
    assert st.parked.size == parked  # as many went out as came in
    trace = st.record.trace()
    assert trace["restored_positions"] and not trace["evicted_positions"]


def test_when_the_pressure_ends_parked_tokens_come_back_best_first():
    sim, rng = shed_sim()
    st = sim.core.states["a"]
    st.parked.score = np.arange(st.parked.size, dtype=float)  # the newest parked score highest
    best = st.parked.logical[np.argsort(-st.parked.score, kind="stable")]
    sim.finish("b")  # the pool has room again, and nothing waits
    before = st.table.num_live
    sim.step({"a": 1})
    sim.check()
    back = st.table.num_live - before - 1
    assert back > 0 and sim.core.totals.tokens_reinflated == back
    restored = set(st.record.trace()["restored_positions"])
    assert restored == set(best[:back].tolist()), "the best parked tokens first"
    if st.parked.size == 0:
        assert st.table.num_live == st.table.num_logical


def test_nothing_comes_back_while_a_request_waits_or_in_always_mode():
    sim, rng = shed_sim()
    live = {rid: sim.core.states[rid].table.num_live for rid in ("a", "b")}
    sim.step({"a": 1, "b": 1}, waiting=[4])  # something waits (a small request that fits): no re-inflation
    assert all(sim.core.states[rid].table.num_live == live[rid] + 1 for rid in ("a", "b"))
    assert sim.core.totals.tokens_reinflated == 0
    always = KVSim(num_blocks=64, block_size=BS, tier_tokens=256)
    always.add("r", prompt=32, policy=make_policy("snapkv", budget=0.25, sink=0, recent=0))
    always.step({"r": 32})
    always.core.receive_stats("r", {ATTN_SUM: rng.random(32)})
    always.step({"r": 1})  # the boundary after the prompt: to its budget, parking the rest
    st = always.core.states["r"]
    assert st.parked.size == 24 and st.table.num_live == 8
    always.step({"r": 1})
    assert always.core.totals.tokens_reinflated == 0 and st.table.num_live == 9


def test_a_full_tier_frees_the_oldest_parked_tokens_of_any_request_first():
    sim = KVSim(num_blocks=64, block_size=BS, tier_tokens=24)
    policy = make_policy("snapkv", budget=0.25, sink=0, recent=0)
    rng = np.random.default_rng(1)
    sim.add("old", prompt=32, policy=policy)
    sim.step({"old": 32})
    sim.core.receive_stats("old", {ATTN_SUM: rng.random(32)})
    sim.step({"old": 1})  # parks 24: the tier is full
    sim.add("new", prompt=16, policy=policy)
    sim.step({"old": 1, "new": 16})
    sim.core.receive_stats("new", {ATTN_SUM: rng.random(16)})
    sim.step({"old": 1, "new": 1})  # parks 12: the 12 oldest of "old" make room
    old, new = sim.core.states["old"], sim.core.states["new"]
    assert new.parked.size == 12 and old.parked.size == 12
    assert sim.core.totals.tokens_dropped_full == 12 and len(old.record.trace()["evicted_positions"]) == 12
    sim.check()
    sim.core.check_integrity()


def test_admission_reserves_what_each_request_may_park():
    """A request is never admitted into a tier that cannot hold what it will park (its tokens at their longest less
    what its budget keeps); with nothing running the first is admitted whatever it needs."""
    sim = KVSim(num_blocks=64, block_size=BS, tier_tokens=100)
    policy = make_policy("snapkv", budget=0.25, sink=0, recent=0)
    core = sim.core
    assert core.tier_need(policy, 80) == 60 and core.tier_need(make_policy("random", budget=0.25), 80) == 0
    assert core.tier_admissible([60, 60]) == 1  # 120 > 100: the second waits
    assert core.tier_admissible([500]) == 1  # nothing runs: admitted anyway (a full tier frees its oldest first)
    core.admit("a", "a", policy, prefill_len=40, max_len=80)
    assert core.states["a"].tier_need == 60
    assert core.tier_admissible([40, 1]) == 1 and core.tier_admissible([41]) == 0


def test_a_recall_on_a_short_pool_sheds_in_the_same_choice_so_no_forward_loses_its_block():
    """Issue 58: a pressure-mode request recalls at every step (recall_every 1) on a pool with no free block, and its
    next token needs a new one. Its recall is its one compaction of the step, so it used to be left out of the shed:
    nobody gave back the block, and vLLM preempted a running request for its growth. Now the recall chooses among
    live and parked tokens keeping what the shed leaves it: parked winners still come back, and every forward runs."""
    sim = KVSim(num_blocks=16, block_size=BS, tier_tokens=256)
    policy = make_policy("snapkv", budget=0.25, sink=0, recent=0)
    rng = np.random.default_rng(2)
    for rid in ("a", "b"):
        sim.add(rid, prompt=32, policy=policy, pressure=True)
    sim.step({"a": 32, "b": 32})  # every block taken
    for rid in ("a", "b"):
        sim.core.receive_stats(rid, scores(sim, rid, False, rng))
    sim.step({"a": 1, "b": 1})  # each next token needs a block: both shed one token, and park it
    for n in range(6):
        for rid in ("a", "b"):  # the window scored over live and parked keys: both recall now
            sim.core.receive_stats(rid, scores(sim, rid, True, rng))
        before = {rid: r.computed for rid, r in sim.reqs.items()}
        recalled = sim.core.totals.tokens_recalled
        sim.step({"a": 1, "b": 1})
        sim.check()  # recalled tokens' K and V came back byte for byte
        assert {rid: r.computed - before[rid] for rid, r in sim.reqs.items()} == {"a": 1, "b": 1}, (
            f"step {n}: a forward found no free block (vLLM would preempt a running request for its growth)"
        )
        assert sim.core.totals.tokens_recalled > recalled, "parked winners still come back"
        for rid in ("a", "b"):
            st = sim.core.states[rid]
            assert st.phase is Phase.KEEPING and st.table.num_live >= st.keep(st.table.num_logical)
    assert sim.core.totals.recalls == 12
