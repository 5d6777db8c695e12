"""Placement strategies on hand-made replica views (no Ray). The block estimate they place by is the compactor's
own rule, tested in tests/test_budget.py."""

from __future__ import annotations

import pytest

from cluster.placement import STRATEGIES, ReplicaView, make_strategy


# ------------------------------------------------------------------------------ placement
def views():
    return [
        ReplicaView("a", free_blocks=100, total_blocks=128, promised=90),
        ReplicaView("b", free_blocks=40, total_blocks=128),
        ReplicaView("c", free_blocks=60, total_blocks=128, stale=True),
    ]


def test_free_blocks_counts_promised_blocks_and_distrusts_stale_reports():
    assert make_strategy("free_blocks").choose(views(), 4).name == "b"
    fresh = [v._replace(stale=False) for v in views()]
    assert make_strategy("free_blocks").choose(fresh, 4).name == "c"


def test_round_robin_cycles_and_power_of_two_picks_the_better_of_two():
    rr = make_strategy("round_robin")
    assert [rr.choose(views(), 1).name for _ in range(4)] == ["a", "b", "c", "a"]
    p2 = make_strategy("power_of_two")
    two = views()[:2]
    assert all(p2.choose(two, 1).name == "b" for _ in range(10))
    assert {"free_blocks", "round_robin", "power_of_two", "best_fit", "weighted"} <= set(STRATEGIES)
    with pytest.raises(ValueError, match="unknown placement strategy"):
        make_strategy("x")
