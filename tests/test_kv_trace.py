"""Random traces through the engine's own compactor (vtoken/core/compactor.py), several requests sharing one block
pool, on real KV tensors in vLLM's layouts: live tokens' K and V bytes survive every step, blocks are accounted
exactly, and ``Compactor.check_integrity`` holds after every step."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvsim import KVSim

from vtoken.core.accounting import naive_retained_blocks
from vtoken.core.policies import ATTN_SUM, make_policy
from vtoken.kv.mover import CpuMover

REQS = ("a", "b", "c", "d")
PROTECTED = {"a": 0, "b": 1, "c": 0, "d": 0}  # request b shares its first block (a cached prefix)

# One step: request `rid` evicts (the test's choice, or its policy at `budget`), another request computes `n`
# new tokens in the same step (so it may be handed the blocks just freed).
steps = st.lists(
    st.tuples(
        st.sampled_from(["kill", "kill", "policy", "forward", "finish"]),
        st.integers(0, 3),
        st.integers(1, 12),
        st.integers(0, 2**31),
    ),
    min_size=1,
    max_size=40,
)


def run_trace(trace, layout="cpu", mover=None, mode="vtoken"):
    sim = KVSim(num_blocks=64, block_size=4, layout=layout, mover=mover, mode=mode)
    for rid in REQS:
        sim.add(rid, prompt=0, num_protected=PROTECTED[rid])
        sim.step({rid: 5})
    for op, i, n, seed in trace:
        rid, other = REQS[i], REQS[(i + 1) % 4]
        if rid not in sim.reqs:
            continue
        forwards = {other: n} if other in sim.reqs else {}
        if op == "kill":
            sim.step(forwards, {rid: (n, seed)})
            if rid in sim.evicted:
                moved, lower_bound, keep, live_after = sim.evicted[rid]
                assert moved == lower_bound  # fewest moves
                assert keep == max(-(-live_after // 4), PROTECTED[rid])  # packed onto the floor
        elif op == "policy":  # the request's own policy evicts down to n tokens at this step
            sim.core.states[rid].policy = make_policy("random", budget=n + 4, sink=1, recent=2)
            sim.step({**forwards, rid: 1})
        elif op == "forward":
            sim.step({rid: n, **forwards})
        elif op == "finish":
            sim.finish(rid)
        sim.check()
        for q, s in sim.core.states.items():
            assert s.table.naive_blocks() == naive_retained_blocks(s.table.live_mask(), 4)
            if mode == "vtoken" and not s.in_prefill:
                assert len(sim.reqs[q].blocks) <= max(-(-(s.table.num_live + 12) // 4), PROTECTED[q]) + 1
    return sim


@given(steps)
def test_live_kv_bytes_survive_random_traces(trace):
    run_trace(trace)


@given(steps)
def test_same_in_the_flash_layout(trace):
    run_trace(trace, layout="flash")


@given(steps)
def test_naive_mode_holds_ballast_apart(trace):
    """Naive mode: the same decisions, ballast never overlaps a block list (check_integrity), bytes survive."""
    run_trace(trace, mode="naive")


def test_all_blocks_return_to_the_pool():
    sim = run_trace([("kill", i, 6, i) for i in range(4)] + [("finish", i, 1, 0) for i in range(4)])
    assert sim.pool.get_num_free_blocks() == 64 - len(sim.shared)


def test_negative_control_mover_with_wrong_layout_is_caught():
    trace = [("forward", 0, 12, 0), ("kill", 0, 6, 3)]
    with pytest.raises(AssertionError, match="live KV bytes changed"):
        run_trace(trace, mover=_WrongLayoutMover())


class _WrongLayoutMover(CpuMover):
    """Planted bug: ignores that K is transposed inside a CPU block."""

    def __init__(self):
        super().__init__(4, "flash")

    def apply(self, kv_caches, batch, extra=()):
        nb, h = kv_caches[0].shape[:2]
        super().apply([t.view(nb, h, 4, -1) for t in kv_caches], batch, extra)


def test_negative_control_skipping_moves_is_caught():
    class NoMover(CpuMover):
        def apply(self, kv_caches, batch, extra=()):
            pass

    with pytest.raises(AssertionError, match="live KV bytes changed"):
        run_trace([("forward", 0, 12, 0), ("kill", 0, 6, 3)], mover=NoMover(4))


def test_negative_control_integrity_catches_a_block_held_twice():
    from vtoken.core.compactor import CompactorError

    sim = run_trace([("forward", 0, 12, 0)])
    sim.reqs["c"].blocks.append(sim.reqs["a"].blocks[-1])  # planted bug: two requests own one block
    with pytest.raises(CompactorError, match="held by"):
        sim.core.check_integrity()


def test_naive_accounting_examples():
    assert naive_retained_blocks(np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 1], bool), 4) == 2  # block 0 + tail
    assert naive_retained_blocks(np.zeros(8, bool), 4) == 0
    assert naive_retained_blocks(np.array([], bool), 4) == 0


def test_replay_of_a_request_life():
    from vtoken.core.replay import replay

    r = replay(make_policy("random", budget=0.25, sink=4, recent=16), prompt_len=1000, output_len=200, block_size=32)
    assert r.live == max(4 + 16, int(np.ceil(0.25 * 1200)))
    assert r.floor <= r.retained <= r.floor + 1 and r.retained < r.naive_retained
    assert r.mean_retained < r.mean_naive_retained and r.moves > 0
    with pytest.raises(ValueError, match="needs"):
        replay(make_policy("h2o"), 10, 10, 32)


def test_one_compaction_per_request_per_step():
    from vtoken.core.compactor import CompactorError

    sim = run_trace([("forward", 0, 12, 0)])
    st = sim.core.states["a"]
    sim.core.plan_step([])
    sim.core.evict(st, st.table.live_logical()[:2])
    with pytest.raises(CompactorError, match="compacted twice"):
        sim.core.evict(st, st.table.live_logical()[:2])


@given(
    chunks=st.integers(8, 12),
    chunk=st.integers(3, 13),
    budget=st.floats(0.05, 0.7),
    sink=st.integers(0, 4),
    recent=st.integers(0, 8),
    decode=st.integers(0, 20),
)
def test_peak_bound_through_chunked_prefill(chunks, chunk, budget, sink, recent, decode):
    """Eviction at every chunk boundary: during every forward the request holds at most
    ceil((keep + new) / block_size) + 1 blocks (keep: what the budget allows at the length read so far), in
    vtoken mode; the same decisions in naive mode hold more."""
    prompt = chunks * chunk - chunk // 2
    peaks = {}
    for mode in ("vtoken", "naive"):
        sim = KVSim(num_blocks=256, block_size=4, mode=mode)
        sim.add("r", prompt=prompt, policy=make_policy("random", budget=budget, sink=sink, recent=recent))
        while sim.reqs["r"].computed < prompt:
            sim.step({"r": min(chunk, prompt - sim.reqs["r"].computed)})
            sim.check()
        for _ in range(decode):
            sim.step({"r": 1})
            sim.check()
        rec = sim.core.states["r"].record
        assert sum(rec.prefill_chunks) == prompt and len(rec.prefill_chunks) == -(-prompt // chunk)
        peaks[mode] = rec.peak_retained
        if mode == "vtoken":
            assert rec.over_bound <= 0, f"held {rec.over_bound} blocks over the bound"
    assert peaks["naive"] >= peaks["vtoken"]


def test_negative_control_without_prefill_eviction_the_bound_breaks():
    sim = KVSim(num_blocks=256, block_size=4)
    sim.add("r", prompt=80, policy=make_policy("random", budget=0.1, sink=0, recent=0), prefill_evict=False)
    for _ in range(10):
        sim.step({"r": 8})
    assert sim.core.states["r"].record.over_bound > 0


def test_shared_blocks_after_a_private_one_are_kept_whole_not_a_crash():
    """vLLM can hand a request a mix of cached copies, so a block another request holds may follow a private one
    (a review found that the planner then raised inside the scheduler). Every block up to the last shared one
    is kept whole: nothing in it is evicted or moved."""
    sim = KVSim(num_blocks=32, block_size=4)
    sim.add("r", prompt=0, policy=make_policy("random", budget=4, sink=0, recent=0))
    sim.step({"r": 20})
    blocks = sim.reqs["r"].blocks
    for b in (blocks[0], blocks[2]):
        b.ref_cnt += 1  # another request holds blocks 0 and 2, not block 1
    kept = [b.block_id for b in blocks[:3]]
    sim.step({"r": 1})
    sim.check()
    st = sim.core.states["r"]
    died = np.concatenate(st.record.died_pos)
    assert died.size and died.min() >= 12  # nothing in the first three blocks died
    assert [b.block_id for b in sim.reqs["r"].blocks[:3]] == kept and (st.table.slot_of[:12] == np.arange(12)).all()


def test_the_boundary_after_the_last_chunk_evicts_whatever_the_interval():
    """With interval=3 the last prefill chunk's tokens are not kept until decode step 3: the boundary after the
    last chunk is a chunk boundary (policy step 0), as the bound (docs/concepts.md) needs."""
    sim = KVSim(num_blocks=64, block_size=4)
    sim.add("r", prompt=40, policy=make_policy("random", budget=0.25, sink=0, recent=0, interval=3))
    for _ in range(4):
        sim.step({"r": 10})
    sim.step({"r": 1})
    rec = sim.core.states["r"].record
    assert 4 in np.concatenate(rec.died_forward).tolist()  # evicted before forward 4, the first decode step
    assert rec.over_bound <= 0


def test_score_every_observes_one_decode_step_in_k_and_evicts_only_after_those():
    """h2o with score_every=3 (the opt-in cheaper scoring): the worker is asked to observe decode steps 3, 6, 9
    only, each exporting its statistics, and tokens die only at the forward that follows one of them."""
    sim = KVSim(num_blocks=64, block_size=4)
    sim.add("r", prompt=8, policy=make_policy("h2o", budget=6, sink=0, recent=0, score_every=3), prefill_evict=False)
    asks, scheduled = [], sim.core.scheduled

    def spy(rid, new_tokens, num_computed_after, num_output):
        ask = scheduled(rid, new_tokens, num_computed_after, num_output)
        asks.append((num_output + 1, ask))
        return ask

    sim.core.scheduled = spy
    sim.step({"r": 8})  # the prompt: decode step 1 samples the first output token
    for _ in range(10):
        step, ask = asks[-1]
        if ask is not None and ask.export:  # the worker's statistics after an observed forward
            n = sim.core.states["r"].table.physical_len + 1  # the table learns of the decode token next step
            sim.core.receive_stats("r", {ATTN_SUM: np.random.default_rng(step).random(n)})
        sim.step({"r": 1})
    sim.check()
    observed = [step for step, ask in asks if ask is not None]
    assert observed == [3, 6, 9] and all(ask.queries == 1 and ask.export for _, ask in asks if ask is not None)
    died = sorted(set(np.concatenate(sim.core.states["r"].record.died_forward).tolist()))
    assert died == [3, 6, 9]  # forward f+1 follows the forward that completed step f (the prompt is forward 1)
