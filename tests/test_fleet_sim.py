"""The fleet simulator (cluster/sim/): hand-computed runs on a scripted workload, the project's own placement
and autoscaler in the loop (planted changes in them change the result), the committed calibration."""

import pytest

from cluster.config import AutoscalingConfig
from cluster.placement import strategies
from cluster.sim import calibration, study
from cluster.sim.calibration import BlockProfile, Calibration, StepTime
from cluster.sim.fleet import Fleet, FleetConfig
from cluster.sim.workload import Request, burst_times, lognormal, poisson_times

# 10 ms a step, 1 ms a decoding request, 0.1 ms a prefill token; no eviction (a block per 32 tokens + 1).
STEPS = StepTime(base=0.01, per_decode=0.001, per_prefill_token=0.0001, per_prefill_seq=0.0)


def cal(max_num_seqs=256) -> Calibration:
    full = BlockProfile.full()
    profiles = {calibration.profile_key("vtoken", pe, None): full for pe in (True, False)}
    return Calibration(32, 4096, max_num_seqs, {"vtoken": STEPS}, profiles, {})


def run(reqs, max_num_seqs=256, **kw):
    fleet = Fleet(FleetConfig(check=True, **kw), cal(max_num_seqs))
    return fleet, fleet.run(reqs)


def test_queueing_one_sequence_slot():
    """max_num_seqs=1: B waits for A. A: prefill 64 (10 + 6.4 ms), 2 decodes (11 ms each); then B the same."""
    _, out = run([Request(0, 0.0, 64, 3), Request(1, 0.0, 64, 3)], max_num_seqs=1, replicas=1, pools=(100,))
    assert out.done[0] == pytest.approx(0.0164 + 2 * 0.011)
    assert out.first[1] == pytest.approx(0.0384 + 0.0164)
    assert out.done[1] == pytest.approx(0.0384 + 0.0164 + 2 * 0.011)
    assert out.preemptions == 0


def test_block_exhaustion_preempts_the_last_and_recomputes():
    """Pool 5: A and B (32-token prompts, 2 blocks each) prefill together (10 + 6.4 ms); their first decodes
    need 3 blocks each, 6 > 5: B, the last, preempts itself and waits. A decodes alone (11 ms); then B is
    admitted again beside A's last decode (10 + 1 + 3.2 ms) and decodes twice (11 ms each)."""
    _, out = run([Request(0, 0.0, 32, 3), Request(1, 0.0, 32, 3)], replicas=1, pools=(5,))
    assert out.preemptions == 1
    assert out.done[0] == pytest.approx(0.0164 + 0.011 + 0.0142)
    assert out.first[1] == pytest.approx(0.0416)
    assert out.done[1] == pytest.approx(0.0416 + 2 * 0.011)


def test_decode_run_equals_single_steps(monkeypatch):
    """The decode-run shortcut (k identical steps as one event) against the plain reference, one step per
    event (the shortcut switched off): the same end times, with arrivals and a cancellation cutting runs."""
    from cluster.sim.replica import Replica

    reqs = [
        Request(0, 0.0, 40, 50),
        Request(1, 0.0, 300, 20),
        Request(2, 0.13, 10, 30),
        Request(3, 0.2, 90, 60, deadline_s=0.31),
        Request(4, 0.21, 500, 5),
    ]
    _, fast = run(reqs, replicas=1, pools=(30,))
    # By hand: request 0 alone prefills 40 tokens (14 ms); request 1 joins with 300 (41 ms); both decode.
    assert fast.first[1] == pytest.approx(0.014 + 0.041)
    monkeypatch.setattr(Replica, "_decode_run", lambda self: None)
    _, ref = run(reqs, replicas=1, pools=(30,))
    assert fast.done.keys() == ref.done.keys() and fast.cancelled == ref.cancelled == {3}
    assert all(fast.done[i] == pytest.approx(ref.done[i]) for i in ref.done)
    assert fast.preemptions == ref.preemptions


def test_one_placement_decision_by_the_real_strategies():
    """Pools of 4 and 16 blocks, one request: free_blocks picks the larger pool; round_robin the first name."""
    for strategy, expected in (("free_blocks", "r0002"), ("round_robin", "r0001"), ("best_fit", "r0001")):
        _, out = run([Request(0, 0.0, 32, 2)], strategy=strategy, replicas=2, pools=(4, 16))
        assert out.placed_on[0] == expected, strategy


def test_one_scale_out_by_the_real_autoscaler():
    """One replica of 4 blocks, two requests of 3 blocks: the second waits; at the first tick (1 s) the
    autoscaler sees a waiting request and scales out to 2; the new replica is ready start_s later."""
    auto = AutoscalingConfig(enabled=True, min_replicas=1, max_replicas=2, sustain_s=0, cooldown_s=0)
    reqs = [Request(0, 0.0, 64, 400), Request(1, 0.01, 64, 2)]
    fleet, out = run(reqs, replicas=1, pools=(4,), autoscaling=auto, start_s=5.0)
    assert [(t, a, b) for t, a, b, _ in out.decisions][:1] == [(1.0, 1, 2)]
    assert "1 waiting" in out.decisions[0][3]
    assert (1.0, 2) in out.replicas
    assert out.placed_on == {0: "r0001", 1: "r0001"}


def test_a_planted_strategy_changes_the_result(monkeypatch):
    """The simulator calls cluster/placement/strategies.py itself: a free_blocks that picks the least free replica
    changes where requests go and how many meet the deadline on the goodput load."""
    real = calibration.load()
    before = study.validate(real, strategies=("free_blocks",))
    monkeypatch.setattr(
        strategies.FreeBlocks, "choose", lambda self, replicas, need: min(replicas, key=lambda r: r.effective_free)
    )
    after = study.validate(real, strategies=("free_blocks",))
    assert before["runs"] != after["runs"]
    assert before["runs"]["free_blocks"]["heavy_per_replica"] == [3, 3]


def test_a_planted_autoscaler_changes_the_result(monkeypatch):
    from cluster.control.autoscaler import Autoscaler

    auto = AutoscalingConfig(enabled=True, min_replicas=1, max_replicas=2, sustain_s=0, cooldown_s=0)
    reqs = [Request(0, 0.0, 64, 400), Request(1, 0.01, 64, 2)]
    monkeypatch.setattr(Autoscaler, "decide", lambda self, now, replicas, current, limit=None: None)
    _, out = run(reqs, replicas=1, pools=(4,), autoscaling=auto, start_s=5.0)
    assert out.decisions == [] and max(n for _, n in out.replicas) == 1


def test_workloads_are_seeded():
    import random

    a, b = random.Random(3), random.Random(3)
    assert poisson_times(a, 5, 10) == poisson_times(b, 5, 10)
    assert burst_times(a, 5, 40) == burst_times(b, 5, 40)
    xs = [lognormal(a, 200, 1.0, 4, 1024) for _ in range(2000)]
    assert 4 <= min(xs) and max(xs) <= 1024 and 150 < sorted(xs)[1000] < 260  # median near 200


def test_best_fit_and_weighted_choose_as_documented():
    """best_fit: the tightest replica that fits (fresh first), else the most free; weighted: the free share
    less the work left (tokens to go) and waiting, each against the busiest; both put a replica that fits first."""
    from cluster.placement.strategies import ReplicaView, make_strategy

    vs = [
        ReplicaView("a", free_blocks=50, total_blocks=64, running=8, tokens_to_go=800),
        ReplicaView("b", free_blocks=12, total_blocks=128, running=1, tokens_to_go=100),
        ReplicaView("c", free_blocks=120, total_blocks=128, promised=100, running=0),
        ReplicaView("d", free_blocks=9, total_blocks=64, stale=True),
    ]
    bf = make_strategy("best_fit")
    assert bf.choose(vs, 10).name == "b"  # 12 fits 10 most tightly (d is tighter but stale)
    assert bf.choose(vs, 30).name == "a"  # only a has 30 effectively free
    assert bf.choose(vs, 60).name == "a"  # nothing fits: the most effective free, as free_blocks
    w = make_strategy("weighted")
    # a: 50/64 - 800/800 = -0.22; b: 12/128 - 100/800 = -0.03; c: 20/128 - 0 = 0.16 -> c
    assert w.choose(vs, 10).name == "c"
    assert w.choose(vs, 30).name == "a"  # the only one that fits


def test_break_point_ratio_and_its_ceiling_by_hand():
    """At round_robin's break every setup's goodput against it, and the ceiling: what arrived over what
    round_robin served (200 requests in 10 s against its 16 req/s: 1.25x at most)."""
    from vtoken.bench.fleet import _break_point

    def pt(att, g, n):
        return {"attainment": att, "goodput_rps": g, "requests": n}

    sweep = {"rates": [10, 20], "results": {"rr": [pt(1.0, 10, 100), pt(0.8, 16, 200)],
                                            "fb": [pt(1.0, 10, 100), pt(1.0, 20, 200)]}}  # fmt: skip
    b = _break_point(sweep, "rr", 0.95, 10.0)
    assert b["rate"] == 20 and b["offered_rps"] == 20.0
    assert b["vs_round_robin"] == {"rr": 1.0, "fb": 1.25} and b["ceiling_vs_round_robin"] == 1.25
    assert _break_point({"rates": [10], "results": {"rr": [pt(1.0, 10, 100)]}}, "rr", 0.95, 10.0) == {"rate": None}


def test_sla_throughput_is_the_last_load_met_before_the_first_miss(monkeypatch):
    """A scripted attainment against the load: met up to 13, missed at 14, met again at 15 (one seed's noise)
    and from 20 on missed. Steps of 4 from 2 find the miss at 14, then steps of 1 from 10: 13, not 15."""
    misses = {14.0} | {float(r) for r in range(20, 40)}
    monkeypatch.setattr(
        study, "at_load", lambda cal, spec, setup, n, rate: {"attainment": 0.0 if rate in misses else 1.0}
    )
    setup = study.SETUPS[1]
    assert study.capacity(None, study.FleetSpec(), setup, 2, 2.0) == {"rate": 13.0, "first_miss": 14.0}
    assert study.capacity(None, study.FleetSpec(), setup, 2, 14.0) == {"rate": None, "first_miss": 14.0}
    misses.discard(14.0)  # the coarse miss at 22 (2, 6, ..., 18 met), then 19 met and 20 missed
    assert study.capacity(None, study.FleetSpec(), setup, 2, 2.0) == {"rate": 19.0, "first_miss": 20.0}


# ------------------------------------------------------------------------------ prefix caches (issue 43)
def test_a_conversations_next_turn_reads_its_cached_blocks_by_hand():
    """Turn 1 (64 tokens, blocks 1 and 2) prefills (10 + 6.4 ms) and decodes twice (11 ms each): done at 38.4 ms,
    its 66 computed tokens leave blocks 1 and 2 in the cache. Turn 2 arrives 1 s later with 128 tokens (blocks 1-4):
    it reads 64 from the cache and prefills 64 (16.4 ms), where without a cache it prefills all 128 (22.8 ms)."""
    turn2 = Request(1, 0.0, 128, 2, prefix=(1, 2, 3, 4), think_s=1.0)
    turn1 = Request(0, 0.0, 64, 3, prefix=(1, 2), then=turn2)
    fleet, out = run([turn1], replicas=1, pools=(100,), prefix_cache=True)
    assert out.done[0] == pytest.approx(0.0384) and out.arrived[1] == pytest.approx(1.0384)
    assert out.hit == {0: 0, 1: 64}
    assert out.first[1] - out.arrived[1] == pytest.approx(0.0164)
    _, cold = run([turn1], replicas=1, pools=(100,))
    assert cold.hit == {0: 0, 1: 0} and cold.first[1] - cold.arrived[1] == pytest.approx(0.0228)
    # the controller's index, fed by the reports' deltas, holds what the replica's cache holds
    (name,) = fleet.replicas
    assert set(fleet.index[name].hashes) == set(fleet.replicas[name].cache.names) == {1, 2, 3, 4}


def test_the_cache_is_bounded_by_the_pool_and_drops_the_least_recently_used():
    from cluster.sim.prefix_cache import PrefixCache

    c = PrefixCache(3)
    c.store([1, 2, 3])
    c.touch([1])
    c.store([4])  # 2 is the least recently used
    c.check_integrity()
    assert list(c.names) == [3, 1, 4] and c.match([1, 2]) == 1
    d = c.cut()
    assert d.seq == 1 and set(d.added) == {1, 3, 4} and d.removed == ()  # 2 came and went between two reports
    assert c.cut().seq == 1  # nothing since: an empty delta under the last number


def chat_spec(horizon_s=10.0):
    return study.ChatFleetSpec(horizon_s=horizon_s)


def test_prefix_placement_follows_conversations_near_the_oracle_and_far_above_weighted():
    """16 replicas, conversations over 4 shared system prompts: every strategy caches the system prompts, only the
    prefix-aware ones find each conversation's own blocks again. prefix, placing by the controller's index of each
    cache (the reports' deltas), comes within 3 points of the oracle that reads every cache, under the same guard."""
    real = calibration.load()
    got = {s: study.chat_run(real, chat_spec(), s, 16, 16.0) for s in ("round_robin", "weighted", "prefix",
                                                                          "prefix_oracle")}  # fmt: skip
    hit = {s: r["hit_rate"] for s, r in got.items()}
    assert hit["prefix"] > hit["weighted"] + 0.15 and hit["prefix"] > hit["round_robin"] + 0.15, hit
    assert abs(hit["prefix_oracle"] - hit["prefix"]) < 0.03, hit
    assert len({r["turns"] for r in got.values()}) == 1  # the same conversations, all served
    assert study.chat_run(real, chat_spec(), "prefix", 16, 16.0) == got["prefix"]  # seeded: the same run


def test_a_planted_prefix_strategy_that_ignores_the_index_loses_its_hits(monkeypatch):
    real = calibration.load()
    before = study.chat_run(real, chat_spec(), "prefix", 16, 16.0)["hit_rate"]
    monkeypatch.setattr(strategies.Prefix, "choose", lambda self, replicas, need: self.weighted.choose(replicas, need))
    after = study.chat_run(real, chat_spec(), "prefix", 16, 16.0)["hit_rate"]
    assert after < before - 0.15


def test_with_more_system_prompts_than_a_pool_holds_prefix_halves_the_ttft_and_with_few_it_ties():
    """vtoken bench fleet_chat's two workloads on 16 replicas (seeded, so the figures are the simulator's, not the
    machine's): with 32 system prompts of 1,536 tokens, weighted spreads each over every replica and their caches
    churn, while prefix keeps each where it was read, so its median turn reads its prompt from a cache and starts
    in under half weighted's time; with 4 short ones every replica caches them all, so the two tie (within 10%)."""
    from vtoken.bench.fleet_chat import spec

    real = calibration.load()
    p50 = {}
    for workload in ("long", "cached"):
        s = spec(workload, 10.0, 0)
        p50[workload] = {k: study.chat_run(real, s, k, 16, 16.0)["ttft_p50_s"] for k in ("weighted", "prefix")}
    assert p50["long"]["prefix"] <= 0.5 * p50["long"]["weighted"], p50
    assert abs(p50["cached"]["prefix"] / p50["cached"]["weighted"] - 1) < 0.1, p50


def test_a_planted_prefix_strategy_that_ignores_the_index_does_not_halve_the_ttft(monkeypatch):
    """The negative control of the test above: the same long workload, prefix choosing as weighted does."""
    from vtoken.bench.fleet_chat import spec

    real, s = calibration.load(), spec("long", 10.0, 0)
    weighted = study.chat_run(real, s, "weighted", 16, 16.0)["ttft_p50_s"]
    monkeypatch.setattr(strategies.Prefix, "choose", lambda self, replicas, need: self.weighted.choose(replicas, need))
    assert study.chat_run(real, s, "prefix", 16, 16.0)["ttft_p50_s"] > 0.8 * weighted
