"""Placement strategies on hand-made replica views (no Ray). The block estimate they place by is the compactor's
own rule, tested in tests/test_budget.py."""

from __future__ import annotations

import pytest

from cluster.placement.strategies import STRATEGIES, ReplicaView, make_strategy


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


# ------------------------------------------------------------------------------ prefix
def prefix_views(**b):
    """Two like replicas, "b" holding 8 of the prompt's 10 blocks; ``b`` overrides b's fields."""
    a = ReplicaView("a", free_blocks=60, total_blocks=64, running=1, tokens_to_go=200, prompt_blocks=10)
    return [a, a._replace(name="b", **{"prefix_blocks": 8, **b})]


def test_prefix_sends_a_request_where_its_prefix_is_cached_though_weighted_would_not():
    views = prefix_views(running=2, tokens_to_go=400)  # b a little busier
    assert make_strategy("weighted").choose(views, 4).name == "a"
    assert make_strategy("prefix").choose(views, 4).name == "b"
    assert views[1].prefix_share == 0.8 and views[1].requests == 2


def test_prefix_guard_a_loaded_replica_loses_despite_its_match():
    """One hot prefix must not pile every request onto the replica that holds it: beyond max_extra_requests or
    max_extra_work over the least loaded replica that fits, the weighted choice stands."""
    p = make_strategy("prefix")
    assert p.choose(prefix_views(pending=2, tokens_to_go=400), 4).name == "b"  # 2 more requests than "a": allowed
    assert p.choose(prefix_views(pending=3, tokens_to_go=500), 4).name == "a"  # 3 more: the guard
    busy = [v._replace(tokens_to_go=5000) for v in prefix_views()]
    assert p.choose([busy[0], busy[1]._replace(tokens_to_go=5000 + 4096)], 4).name == "b"
    assert p.choose([busy[0], busy[1]._replace(tokens_to_go=5000 + 4097)], 4).name == "a"  # more work than allowed
    assert p.choose(prefix_views(free_blocks=3), 4).name == "a"  # does not fit the request
    assert p.choose(prefix_views(stale=True), 4).name == "a"  # its report is stale


def test_prefix_ignores_a_match_under_a_tenth_of_the_prompt_and_otherwise_is_weighted():
    p, w = make_strategy("prefix"), make_strategy("weighted")
    views = prefix_views(running=2, tokens_to_go=400, prefix_blocks=0)
    assert p.choose(views, 4).name == w.choose(views, 4).name == "a"
    small = [v._replace(prompt_blocks=20) for v in prefix_views(running=2, tokens_to_go=400, prefix_blocks=1)]
    assert p.choose(small, 4).name == "a"  # 1 of 20 blocks: under min_share
    none = [v._replace(prompt_blocks=0, prefix_blocks=0) for v in views]  # a prompt shorter than a block
    assert p.choose(none, 4).name == "a" and "prefix" in STRATEGIES


def test_a_view_matched_to_a_prompt_is_the_view_with_its_two_prefix_fields_replaced():
    v = ReplicaView("a", 60, 64, promised=3, running=1, waiting=2, blocks_reclaimed=4, stale=True, pending=5,
                    tokens_to_go=200, prompt_blocks=1, prefix_blocks=1)  # fmt: skip
    m = v.matched(10, 7)
    assert m == v._replace(prompt_blocks=10, prefix_blocks=7) and type(m) is ReplicaView and m.prefix_share == 0.7


def test_prefix_chooses_as_its_rule_says_on_random_views():
    """The shortcut (no match worth a busier replica: the weighted choice at once) changes no choice: against the
    rule computed in full, on random views."""
    import random

    def by_rule(p, views, need):
        score = p.weighted.scores(views)

        def rank(r, prefix):
            return r.effective_free >= need, not r.stale, score[r.name] + prefix * r.prefix_share, r.name

        fallback, best = max(views, key=lambda r: rank(r, 0.0)), max(views, key=lambda r: rank(r, p.w_prefix))
        if best is fallback or best.prefix_share < p.min_share or p.overloaded(best, views, need):
            return fallback
        return best

    rng, p = random.Random(0), make_strategy("prefix")
    for _ in range(2000):
        prompt = rng.randrange(0, 40)
        views = [ReplicaView(f"r{i}", rng.randrange(0, 64), 64, running=rng.randrange(4), waiting=rng.randrange(3),
                             pending=rng.randrange(3), tokens_to_go=rng.randrange(0, 9000), stale=rng.random() < 0.1,
                             prompt_blocks=prompt, prefix_blocks=rng.randrange(0, prompt + 1) if prompt else 0)
                 for i in range(rng.randrange(1, 6))]  # fmt: skip
        need = rng.randrange(1, 40)
        assert p.choose(views, need) is by_rule(p, views, need)
