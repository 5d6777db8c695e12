"""Schedule (vtoken/core/schedule.py): when a request may evict, which queries are scored, and parking's two points, on
hand-made cases. The compactor, replay and the quality benchmarks all ask this one object."""

import pytest

from vtoken.core.policies import make_policy
from vtoken.core.schedule import Schedule

P = 100  # prefill_len


def test_step_at_chunk_boundaries_the_last_one_and_decode_steps():
    s = Schedule(prefill_evict=True)
    assert s.step_at(0, P, 0) is None  # nothing read yet
    assert s.step_at(40, P, 0) == 0  # a chunk boundary
    assert s.step_at(P, P, 1) == 0  # the boundary after the last chunk, whatever the interval
    assert s.step_at(P + 3, P, 4) == 4  # decode step 4
    off = Schedule(prefill_evict=False)
    assert off.step_at(40, P, 0) is None and off.step_at(P, P, 1) == 1


def test_a_decoding_request_decides_once_it_holds_the_slack_above_what_it_keeps():
    s = Schedule(prefill_evict=True, slack=3)
    got = [s.decision_step(P + k - 1, P, k, excess=e) for k, e in zip(range(2, 7), (1, 2, 3, 4, 0))]
    assert got == [None, None, 4, 5, None]
    assert s.decision_step(40, P, 0, excess=0) == 0 and s.decision_step(P, P, 1, excess=0) == 0  # boundaries: always
    assert s.decision_step(P + 4, P, 5, excess=0, shed=True) == 0  # the pool is short now: step 0
    assert s.decision_step(0, P, 0, excess=9, shed=True) is None  # ... but never before anything was read
    off = Schedule(prefill_evict=False, slack=3)
    assert off.decision_step(40, P, 0, excess=9, shed=True) is None  # no eviction while reading without prefill_evict
    assert off.decision_step(P, P, 1, excess=3) == 1 and off.decision_step(P, P, 1, excess=2) is None
    assert s.decides_after(3) and not s.decides_after(2)
    exact = Schedule(slack=1)
    assert exact.decision_step(P + 5, P, 6, excess=1) == 6 and exact.decision_step(P + 5, P, 6, excess=0) is None


def test_chunk_queries_only_where_the_boundary_after_the_chunk_may_evict():
    s = Schedule(prefill_evict=True, scores=True, window=32)
    assert s.chunk_queries(64, 64, P, over=True) == 32
    assert s.chunk_queries(16, 80, P, over=True) == 16  # a chunk shorter than the window
    assert s.chunk_queries(64, 64, P, over=False) == 0  # under its budget after the chunk: nothing to score
    assert Schedule(prefill_evict=True, scores=True, eager=True).chunk_queries(64, 64, P, over=False) == 32
    assert Schedule(prefill_evict=True, scores=False).chunk_queries(64, 64, P, over=True) == 0
    assert Schedule(prefill_evict=False, scores=True).chunk_queries(64, 64, P, over=True) == 0


def test_decode_ask_per_step_observes_one_step_in_score_every_and_exports_before_a_decision():
    s = Schedule(scores=True, score_every=2)
    got = [s.decode_ask(k, decides=k % 4 == 0) for k in range(1, 5)]
    assert got == [(False, False, False), (True, False, False), (False, False, False), (True, True, False)]
    assert s.decode_ask(3, decides=True) == (False, False, False)  # not observed: the decision waits for one
    assert Schedule(scores=False).decode_ask(4, True) == (False, False, False)


def test_decode_ask_on_demand_observes_nothing_and_scores_the_window_before_a_decision():
    s = Schedule(scores=True, on_demand=True)
    assert all(s.decode_ask(k, decides=False) == (False, False, False) for k in range(1, 9))
    assert s.decode_ask(9, decides=True) == (False, False, True)


def test_parking_stops_short_scores_jointly_and_chooses_one_token_before_the_end():
    s = Schedule()
    assert s.stops_short(True, 30, P, P) and not s.stops_short(False, 30, P, P)
    assert not s.stops_short(True, 1, P, P)  # the last token alone: it is the forward that samples
    assert not s.stops_short(True, 30, P - 10, P)
    assert s.scores_jointly(True, P - 1, P) and not s.scores_jointly(True, P - 2, P)
    assert not s.scores_jointly(False, P - 1, P)
    assert s.chooses(True, P - 1, P) and s.chooses(True, P, P) and not s.chooses(True, P - 2, P)
    assert not s.chooses(False, P - 1, P)


@pytest.mark.parametrize("name", ["h2o", "random", "snapkv"])
def test_of_takes_the_policys_timing_parameters(name):
    kw = {"score_every": 3} if name == "h2o" else {}
    s = Schedule.of(make_policy(name, interval=5, **kw), prefill_evict=False, window=8, eager=True)
    got = (s.slack, s.score_every, s.scores, s.window, s.eager, s.prefill_evict, s.on_demand)
    assert got == (5, 3 if name == "h2o" else 1, name != "random", 8, True, False, name == "snapkv")
    assert Schedule.of(make_policy(name, interval=0), block_size=32).slack == 32  # 0: one KV block
