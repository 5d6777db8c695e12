"""One request's failure stays its own: an exception while vToken decides, compacts or sheds for one request ends
that request (the engine finishes it with an error) and every other request runs on, its KV exact, with every
block freed at the end. Driven through tests/kvsim.py (the real Compactor, no engine); the engine's side, where the
request ends with finish reason "error", is in tests/test_vllm_engine.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from kvsim import KVSim

from vtoken.core.compactor import Compactor
from vtoken.core.policies import make_policy
from vtoken.core.policies.random_policy import Random

BS = 4


class Exploding(Random):
    """A policy that raises whenever it is asked to decide (a bug in a policy, a value it cannot handle)."""

    def score(self, inp):
        raise RuntimeError("injected: this policy cannot decide")


def run(with_failing: bool, pressure: bool = False, blocks: int = 64, isolate: bool = True):
    sim = KVSim(num_blocks=blocks, block_size=BS)
    policy = make_policy("random", budget=0.5, sink=0, recent=0)
    names = ["a", "bad", "c"] if with_failing else ["a", "c"]
    for rid in names:
        p = Exploding(budget=0.5, sink=0, recent=0) if rid == "bad" else policy
        sim.add(rid, prompt=24, policy=p, pressure=pressure)
    failures: dict[str, str] = {}
    sim.step({rid: 12 for rid in names}, failures=failures)
    sim.step({rid: 12 for rid in sim.reqs}, failures=failures)
    for _ in range(10):
        sim.step({rid: 1 for rid in sim.reqs}, failures=failures, waiting=[24] if pressure else ())
        sim.core.check_integrity()
        sim.check()  # every live token's K and V where its TokenTable says, as written
    live = {rid: sim.core.states[rid].table.live_logical().tolist() for rid in sim.reqs}
    for rid in list(sim.reqs):
        sim.finish(rid)
    return sim, failures, live


@pytest.mark.parametrize("pressure", [False, True], ids=["always", "pressure-shed"])
def test_a_policy_that_raises_ends_its_request_alone(pressure):
    blocks = 64 if not pressure else 22  # pressure: the pool runs short, so the requests shed
    sim, failures, live = run(True, pressure, blocks)
    assert list(failures) == ["bad"] and "injected: this policy cannot decide" in failures["bad"]
    _, none, alone = run(False, pressure, blocks)
    assert not none
    if not pressure:  # (a shed depends on the pool, which the failing request held until it failed)
        assert live == alone, "the other requests decided exactly as without the failing one"
    assert any(len(v) < 34 for v in live.values()), "the others evicted: decisions ran after the failure"
    assert sim.pool.get_num_free_blocks() == sim.pool.num_gpu_blocks - 1, "every block back in the pool"
    assert not sim.core.states and not sim.core.take_failed()


def test_negative_control_without_isolation_the_exception_escapes_the_step(monkeypatch):
    """What stopped the engine for every request before: the exception leaves plan_step."""
    monkeypatch.setattr(Compactor, "isolated", lambda self, rid: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="injected"):
        run(True)


def test_a_failed_request_leaves_nothing_of_this_step_behind():
    """The failing request's moves, parks and restores of the step are dropped; the plan moves only the others'."""
    sim = KVSim(num_blocks=64, block_size=BS)
    sim.add("a", prompt=16, policy=make_policy("random", budget=0.5, sink=0, recent=0))
    sim.add("bad", prompt=16, policy=Exploding(budget=0.5, sink=0, recent=0))
    sim.step({"a": 8, "bad": 8}, failures={})
    from vtoken.core.step import Progress

    bad_blocks = {b.block_id for b in sim.reqs["bad"].blocks}
    plan = sim.core.plan_step([Progress(rid, 8, 0, 8) for rid in sim.reqs])
    assert "bad" in sim.core.take_failed()
    touched = np.concatenate([plan.moves.src, plan.moves.dst]) // BS
    assert not set(touched.tolist()) & bad_blocks and "bad" not in plan.keep_blocks and "bad" not in plan.gaps


def test_a_failed_request_is_neither_a_finished_nor_a_preempted_one():
    sim, failures, _ = run(True)
    assert "bad" in failures
    assert sim.core.totals.preemptions == 0
    assert sorted(r["request_id"] for r in sim.core.totals.finished) == ["a", "c"]
