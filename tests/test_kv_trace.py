"""Random append / evict / compact traces over several requests sharing one block pool, on real KV
tensors in vLLM's CPU layout: live tokens' K and V bytes survive, blocks are accounted exactly."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvsim import KVSim

from vtoken.accounting import block_counts, naive_retained_blocks
from vtoken.mover import CpuMover
from vtoken.planner import moves_lower_bound, plan_compaction

ops = st.lists(
    st.tuples(
        st.sampled_from(["append", "append", "kill", "compact", "finish"]),
        st.integers(0, 3),
        st.integers(1, 12),
        st.integers(0, 2**31),
    ),
    min_size=1,
    max_size=50,
)


def run_trace(trace, layout="cpu", planner=plan_compaction, mover=None, protected=(0, 1, 0, 0)):
    sim = KVSim(num_blocks=48, block_size=4, layout=layout, planner=planner, mover=mover)
    for rid, prot in enumerate(protected):
        sim.add(rid, num_protected=prot)
        sim.append(rid, 4 * prot + 1)  # protected blocks are full, as shared prefix blocks are
    for op, rid, n, seed in trace:
        if rid not in sim.reqs:
            continue
        r = sim.reqs[rid]
        if op == "append":
            sim.append(rid, n)
        elif op == "kill":
            live = r.table.live_logical()
            live = live[live >= 4 * r.num_protected]  # never evict tokens of shared blocks
            if live.size:
                sim.kill(rid, np.random.default_rng(seed).choice(live, min(n, live.size), replace=False))
        elif op == "compact":
            before = {q: (s.table.physical_live_mask(), s.num_protected) for q, s in sim.reqs.items()}
            plans = sim.compact()
            for (s, plan), (live, prot) in zip(plans, before.values()):
                assert plan.num_moves == moves_lower_bound(live, 4, prot)
                c = block_counts(s.table)
                assert len(s.blocks) == c.retained == max(c.floor, prot) <= c.naive_retained
        elif op == "finish":
            sim.finish(rid)
        sim.check()
    return sim


@given(ops)
def test_live_kv_bytes_survive_random_traces(trace):
    run_trace(trace)


@given(ops)
def test_same_in_the_flash_layout(trace):
    run_trace(trace, layout="flash")


def test_all_blocks_return_to_the_pool():
    sim = run_trace(
        [("append", r, 9, 0) for r in range(4)]
        + [("kill", r, 6, r) for r in range(4)]
        + [("compact", 0, 1, 0)]
        + [("finish", r, 1, 0) for r in range(4)]
    )
    assert sorted(sim.free) == list(range(48))


def test_negative_control_mover_with_wrong_layout_is_caught():
    trace = [("append", 0, 12, 0), ("kill", 0, 6, 3), ("compact", 0, 1, 0)]
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
        run_trace([("append", 0, 12, 0), ("kill", 0, 6, 3), ("compact", 0, 1, 0)], mover=NoMover(4))


def test_naive_accounting_examples():
    assert naive_retained_blocks(np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 1], bool), 4) == 2  # block 0 + tail
    assert naive_retained_blocks(np.zeros(8, bool), 4) == 0
    assert naive_retained_blocks(np.array([], bool), 4) == 0


def test_replay_of_a_request_life():
    from vtoken.policies import make_policy
    from vtoken.replay import replay

    r = replay(make_policy("random", budget=0.25, sink=4, recent=16), prompt_len=1000, output_len=200, block_size=32)
    assert r.live == max(4 + 16, int(np.ceil(0.25 * 1200)))
    assert r.floor <= r.retained <= r.floor + 1 and r.retained < r.naive_retained
    assert r.mean_retained < r.mean_naive_retained and r.moves > 0
    with pytest.raises(ValueError, match="needs"):
        replay(make_policy("h2o"), 10, 10, 32)
