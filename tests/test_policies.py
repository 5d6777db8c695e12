import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vtoken.bench.footprint import code_lines
from vtoken.core.policies import ATTN_HIST, ATTN_SUM, POLICIES, PolicyInput, make_policy, policy_params


def inp(n, step=1, live=None, seed=0, protected=None):
    live = np.arange(n) if live is None else np.asarray(live)
    rng = np.random.default_rng(seed)
    stats = {ATTN_SUM: rng.random(live.size), ATTN_HIST: rng.integers(0, 2**40, live.size)}
    return PolicyInput(n, step, live, stats, protected, request_seed=7)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(
    n=st.integers(1, 400),
    budget=st.sampled_from([0.125, 0.25, 0.5, 3, 50]),
    sink=st.integers(0, 8),
    recent=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_every_policy_obeys_the_shared_mechanics(name, n, budget, sink, recent, seed):
    policy = make_policy(name, budget=budget, sink=sink, recent=recent)
    rng = np.random.default_rng(seed)
    protected = rng.random(n) < 0.1
    x = inp(n, seed=seed, protected=protected)
    kill = policy.select(x)
    assert np.unique(kill).size == kill.size and np.isin(kill, x.live).all()
    assert not ((kill < sink) | (kill >= n - recent) | protected[kill]).any(), "killed a protected token"
    candidates = int((~((x.live < sink) | (x.live >= n - recent) | protected)).sum())
    assert kill.size == min(max(n - policy.target(n), 0), candidates)
    assert np.array_equal(kill, policy.select(x)), "decisions must be deterministic"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_says_what_not_when(name):
    """Timing is Schedule's alone (tests/test_schedule.py): asked at any step, a policy with interval=4 evicts to
    its budget; only random's draw depends on the step."""
    policy = make_policy(name, budget=0.5, interval=4, sink=0, recent=0)
    assert policy.select(inp(100, step=3)).size == 50
    assert policy.select(inp(100, step=4)).size == 50


def test_h2o_keeps_heavy_hitters():
    x = inp(10)
    kill = make_policy("h2o", budget=5, sink=0, recent=0).select(x)
    assert set(kill) == set(np.argsort(x.stats[ATTN_SUM])[:5])


def test_scissorhands_counts_persistence_in_its_window():
    hist = np.array([0b1111, 0b0001, 0b1110000, 0b0111, 0b1 << 40], dtype=np.int64)
    x = PolicyInput(5, 1, np.arange(5), {ATTN_HIST: hist})
    assert make_policy("scissorhands", budget=2, sink=0, recent=0, history=4).select(x).tolist() == [1, 2, 4]
    # with a 64-step window the old hit of token 4 counts, and token 2's three hits beat token 1's one
    assert make_policy("scissorhands", budget=3, sink=0, recent=0, history=64).select(x).tolist() == [1, 4]


def test_snapkv_keeps_the_neighbours_of_a_heavy_token_together():
    w = np.full(21, 0.1)
    w[10] = 5.0  # one token of a fact drew the window's attention; its neighbours did not
    w[[2, 18]] = 0.2
    x = PolicyInput(21, 1, np.arange(21), {ATTN_SUM: w})
    kept = np.setdiff1d(np.arange(21), make_policy("snapkv", budget=7, sink=0, recent=0, before=3, after=3).select(x))
    assert kept.tolist() == list(range(7, 14))  # the whole neighbourhood, not h2o's scattered 0.2s
    kept = np.setdiff1d(np.arange(21), make_policy("snapkv", budget=7, sink=0, recent=0, before=6, after=0).select(x))
    assert kept.tolist() == list(range(10, 17))  # what follows the attended token: where a fact's value sits
    h2o_kept = np.setdiff1d(np.arange(21), make_policy("h2o", budget=7, sink=0, recent=0).select(x))
    assert {2, 10, 18} <= set(h2o_kept.tolist())


def test_random_is_reproducible_and_varies_with_step_and_seed():
    p = make_policy("random", budget=0.5, sink=0, recent=0, seed=1)
    a, b = p.select(inp(64, step=1)), p.select(inp(64, step=2))
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, make_policy("random", budget=0.5, sink=0, recent=0, seed=2).select(inp(64)))


def test_streaming_keeps_sinks_and_newest():
    kill = make_policy("streaming", budget=8, sink=4, recent=2).select(inp(20))
    assert kill.tolist() == list(range(4, 16))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"budget": 0}, "budget"),
        ({"budget": 2.5}, "whole"),
        ({"interval": -1}, "interval"),
        ({"score_every": 0}, "score_every"),
        ({"sink": -1}, "sink"),
        ({"bogus": 1}, "no parameter"),
    ],
)
def test_bad_parameters_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_policy("h2o", **kwargs)


def test_score_every_is_for_attention_policies_only():
    assert make_policy("scissorhands", score_every=4).score_every == 4
    with pytest.raises(ValueError, match="score_every: applies only to per-step attention policies"):
        make_policy("streaming", score_every=2)


def test_unknown_policy():
    with pytest.raises(ValueError, match="known: h2o, random, scissorhands, snapkv, streaming"):
        make_policy("lru")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_needs_fewer_than_30_lines(name):
    """Counted by the one counter the footprint benchmark reports with (vtoken/bench/footprint.py)."""
    assert code_lines(inspect.getsource(inspect.getmodule(POLICIES[name]))) < 30


def test_the_line_counter_skips_docstrings_comments_and_blank_lines():
    src = 'def f():\n    """Doc\n    string."""\n\n    # a comment\n    return 1  # trailing\n'
    assert code_lines(src) == 2


def test_policy_params_lists_defaults():
    assert policy_params("scissorhands")["history"] == 32


# ------------------------------------------------------------------ declared parameters (issue 46)
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_parameter_declares_its_type_and_range(name):
    import dataclasses
    import typing

    hints = typing.get_type_hints(POLICIES[name])
    for f in dataclasses.fields(POLICIES[name]):
        assert hints[f.name] in (int, float), f"{name}.{f.name}: declare int or float"
        assert {"ge", "gt", "le"} <= set(f.metadata), f"{name}.{f.name}: declare its range with param(...)"


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(data=st.data())
def test_any_parameter_value_makes_a_working_policy_or_a_named_error(name, data):
    """What a request's policy_params may carry (JSON values, at and beyond their edges): either the policy is
    made and decides without raising, or the error names the parameter. A wrong type that passed here once
    raised a TypeError inside the engine's scheduler and stopped it for every request."""
    import dataclasses

    from vtoken.core.policies import PolicyParamError

    names = [f.name for f in dataclasses.fields(POLICIES[name])]
    params = data.draw(st.dictionaries(st.sampled_from(names), JSON_VALUES, max_size=3))
    try:
        policy = make_policy(name, **params)
    except PolicyParamError as e:
        assert e.param in params and str(e).startswith(f"{name}: {e.param}: ")
        return
    x = inp(data.draw(st.integers(1, 200)), seed=data.draw(st.integers(0, 99)))
    kill = policy.select(x)
    assert np.isin(kill, x.live).all()


def test_a_wrong_type_is_refused_naming_the_parameter():
    from vtoken.core.policies import PolicyParamError

    with pytest.raises(PolicyParamError, match="scissorhands: history: must be a whole number, got str 'a'"):
        make_policy("scissorhands", history="a")
    with pytest.raises(PolicyParamError, match=r"snapkv: before: must be >= 0 and <= 4096, got 100000"):
        make_policy("snapkv", before=100_000)
    with pytest.raises(PolicyParamError, match="random: seed: must be >= 0"):
        make_policy("random", seed=-1)
