"""A request's life on the compactor, driven through tests/kvsim.py (the real Compactor, no engine): its phases and
their one transition function, pressure mode's shortfall rule and elastic shedding (tests/test_shedding.py holds the
shedding plan itself), and the trace's bookkeeping across a preemption."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from kvsim import KVSim

from vtoken.core.phase import TRANSITIONS, InvalidPhase, Phase
from vtoken.core.policies import make_policy

BS = 4


def test_an_always_request_reads_then_decodes_and_every_change_is_logged(caplog):
    sim = KVSim(num_blocks=64, block_size=BS)
    sim.add("r", prompt=20, policy=make_policy("random", budget=0.5, sink=0, recent=0))
    assert sim.core.states["r"].phase is Phase.READING
    with caplog.at_level(logging.DEBUG, logger="vtoken.core.compactor"):
        sim.step({"r": 12})
        sim.step({"r": 8})  # the prompt's last chunk
        sim.step({"r": 1})  # the boundary after it: the prompt is read
    assert sim.core.states["r"].phase is Phase.DECODING
    said = [r.getMessage() for r in caplog.records]
    assert said == ["vtoken: request r reading -> decoding (its prompt read (20 tokens))"]


def test_a_transition_outside_the_table_raises():
    sim = KVSim(num_blocks=16, block_size=BS)
    sim.add("r", prompt=8)
    st = sim.core.states["r"]
    assert Phase.KEEPING not in TRANSITIONS[Phase.READING]
    with pytest.raises(InvalidPhase, match="reading -> keeping"):
        sim.core._to(st, Phase.KEEPING, "a bug")
    assert st.phase is Phase.READING
    st.phase = Phase.DECODING
    with pytest.raises(InvalidPhase, match="decoding -> reading"):
        sim.core._to(st, Phase.READING, "a bug")


def pressure_sim(num_blocks: int) -> KVSim:
    """Two pressure-mode requests: ``done`` has read its 24-token prompt and decodes, ``reading`` is half way
    through its 40-token prompt."""
    sim = KVSim(num_blocks=num_blocks, block_size=BS)
    policy = make_policy("random", budget=0.25, sink=0, recent=0)
    sim.add("done", prompt=24, policy=policy, pressure=True)
    sim.add("reading", prompt=40, policy=policy, pressure=True)
    sim.step({"done": 24, "reading": 20})
    sim.step({"done": 1})
    return sim


def test_pressure_keeps_every_token_while_the_pool_holds_the_demand():
    sim = pressure_sim(num_blocks=64)
    assert sim.core.pressure_active()
    for _ in range(3):
        sim.step({"done": 1, "reading": 4}, waiting=[16], watermark=2)  # 6 blocks wanted, plenty free
    assert {rid: st.phase for rid, st in sim.core.states.items()} == {"done": Phase.KEEPING, "reading": Phase.KEEPING}
    assert all(st.table.num_live == st.table.num_logical > 0 for st in sim.core.states.values())
    assert sim.core.totals.tokens_evicted == 0
    sim.check()


def test_pressure_sheds_only_what_the_pool_is_short_and_keeps_the_rest():
    sim = pressure_sim(num_blocks=18)  # 7 + 5 blocks held, 6 free
    free = sim.pool.get_num_free_blocks()
    before = {rid: st.table.num_live for rid, st in sim.core.states.items()}
    # A waiting request's first forward needs 5 blocks, the running ones 2 more: 1 short -> one block comes back.
    sim.step({"done": 1, "reading": 8}, waiting=[5 * BS], watermark=free - 5 - 2 + 1)
    phases = {rid: st.phase for rid, st in sim.core.states.items()}
    assert phases == {"done": Phase.KEEPING, "reading": Phase.KEEPING}  # both go on keeping what they hold
    done, reading = sim.core.states["done"], sim.core.states["reading"]
    # done (24 + 1 tokens read, 7 blocks) gave its cheapest block: 25 + 1 tokens into 7 blocks, 2 in the last one
    assert done.table.num_live == before["done"] + 1 - 2 and done.record.shed_at >= 0
    assert reading.table.num_live == reading.table.num_logical and reading.record.shed_at == -1
    assert done.table.num_live > done.keep(done.table.num_logical)  # far above its budget still
    assert sim.core.pressure_active()
    sim.check()


def test_a_request_sheds_no_further_than_its_budget_however_short_the_pool():
    sim = pressure_sim(num_blocks=18)
    sim.finish("done")
    sim.step({"reading": 8}, waiting=[40 * BS], watermark=0)  # far more than anyone can give
    st = sim.core.states["reading"]
    assert st.phase is Phase.KEEPING and st.record.shed_at >= 0
    # As far as whole blocks come back: a further token would free nothing, or go below the budget.
    assert 0 <= st.table.num_live - st.keep(st.table.num_logical) < BS
    sim.step({"reading": 12})  # the rest of the prompt
    sim.step({"reading": 1}, waiting=[40 * BS])
    assert st.table.num_live >= st.keep(st.table.num_logical)
    sim.check()


def test_a_preempted_request_keeps_its_first_run_in_its_trace_line():
    sim = KVSim(num_blocks=64, block_size=BS, trace=True)
    policy = make_policy("random", budget=0.5, sink=0, recent=0)
    sim.add("r", prompt=16, policy=policy, prefill_evict=False)
    sim.step({"r": 16})
    for _ in range(6):
        sim.step({"r": 1})
    first = sim.core.states["r"].record.trace()
    assert first["evicted_positions"], "the first run evicted"
    sim.preempt("r", policy=policy)
    sim.step({"r": sim.core.states["r"].prefill_len})  # recomputes prompt and outputs
    for _ in range(3):
        sim.step({"r": 1})
    line = sim.finish("r")
    assert line["request_id"] == "r" and line["outputs_at_start"] == 7
    assert line["preempted_runs"] == [first]
    assert np.isin(line["evicted_positions"], np.arange(sim.core.step * 4)).all()
    assert sim.core.remove("r", finished=True) is None  # gone, and no trace left behind


def test_without_tracing_nothing_is_kept_for_a_preempted_request():
    sim = KVSim(num_blocks=32, block_size=BS)
    sim.add("r", prompt=8)
    sim.step({"r": 8})
    sim.preempt("r")
    assert sim.core.traces is None and sim.finish("r") is None


def test_decisions_come_in_block_sized_batches_and_hold_at_most_a_block_more():
    """interval 0 (one block, the engine's default): a decoding request lets its live tokens grow to what it keeps
    plus a block, then evicts back at once: never more than keep + a block - 1 before a forward, decisions once per
    block of excess, and the forward bound (which counts the slack) holds at every forward."""
    sim = KVSim(num_blocks=128, block_size=BS)
    policy = make_policy("random", budget=0.25, sink=0, recent=0, interval=0)
    sim.add("r", prompt=40, policy=policy)
    sim.step({"r": 40})
    st = sim.core.states["r"]
    decisions = 0
    for _ in range(60):
        died_before = len(st.record.died_pos)
        sim.step({"r": 1})
        decisions += len(st.record.died_pos) > died_before
        assert st.table.num_live - st.keep(st.table.num_logical) <= BS, "more than a block above what it keeps"
    sim.check()
    assert st.record.over_bound <= 0
    # 60 steps at 25%: the excess grows by 3/4 a token a step, a decision per 4 tokens of excess: about 11
    assert 9 <= decisions <= 13, decisions
    exact = KVSim(num_blocks=128, block_size=BS)
    exact.add("r", prompt=40, policy=make_policy("random", budget=0.25, sink=0, recent=0, interval=1))
    exact.step({"r": 40})
    for _ in range(60):
        exact.step({"r": 1})
    assert len(exact.core.states["r"].record.died_pos) > 2 * decisions  # interval 1: nearly every step


def test_an_on_demand_policy_records_every_decode_query_and_scores_its_window_only_before_a_decision():
    sim = KVSim(num_blocks=128, block_size=BS)
    sim.add("r", prompt=16, policy=make_policy("snapkv", budget=0.25, sink=0, recent=0, interval=0),
            prefill_evict=False)  # fmt: skip
    asks, scheduled = [], sim.core.scheduled

    def spy(rid, new_tokens, num_computed_after, num_output):
        ask = scheduled(rid, new_tokens, num_computed_after, num_output)
        asks.append(ask)
        if ask is not None and ask.window:  # the worker's window scores, after the forward
            n = sim.core.states["r"].table.physical_len + new_tokens
            sim.core.receive_stats("r", {"attn_sum": np.random.default_rng(len(asks)).random(n)})
        return ask

    sim.core.scheduled = spy
    sim.step({"r": 16})
    for _ in range(30):
        sim.step({"r": 1})
    sim.check()
    decode = asks[1:]
    assert all(a is not None and a.record and a.queries == 0 and not a.export for a in decode)  # no per-step scorer
    windows = [i for i, a in enumerate(decode) if a.window]
    died = sorted(set(np.concatenate(sim.core.states["r"].record.died_forward).tolist()))
    assert windows and [w + 2 for w in windows] == died  # each decision follows a window scored just before it


def test_a_request_that_chooses_with_the_question_while_the_pool_is_short_is_compacted_once():
    """Found by `vtoken bench retrieval --saturate snapkv@0.25:pressure`: a pressure request with parked tokens
    chose with its question (CHOOSING -> KEEPING), and the same step's shed took it again as a keeper, so the
    compactor raised "compacted twice in step". A request decided this step sheds from the next one on."""
    from vtoken.core.park import TierSlots

    sim = KVSim(num_blocks=20, block_size=BS)
    sim.core.tier = TierSlots(256)
    policy = make_policy("h2o", budget=0.25, sink=0, recent=0)
    sim.add("a", prompt=40, policy=policy, pressure=True)
    sim.add("b", prompt=24, policy=policy, pressure=True)
    rng = np.random.default_rng(0)

    def step(forwards, waiting=()):
        sim.step(forwards, waiting=list(waiting))
        for rid in forwards:
            st = sim.core.states[rid]
            stats = {n: rng.random(len(sim.reqs[rid].blocks) * BS) for n in policy.needs}
            stats.update({f"parked:{n}": rng.random(st.parked.size) for n in policy.needs if st.parked.size})
            sim.core.receive_stats(rid, stats)
        # (kvsim moves no bytes to or from the tier, so its byte check holds only until parked tokens come back)

    a = sim.core.states["a"]
    step({"a": 16, "b": 24})
    step({"a": 16, "b": 1}, waiting=[40])
    step({"a": 7, "b": 1}, waiting=[40])  # short while a reads its prompt: it parks what it sheds
    assert a.parked.size > 0 and a.phase is Phase.KEEPING
    sim.check()
    step({"a": 1, "b": 1}, waiting=[60])  # the question read: a chooses, and the pool is short in the same step
    assert a.phase is Phase.KEEPING and a.chose and a.compacted_at == sim.core.step  # its losers stay parked
    live = a.table.num_live
    step({"a": 1, "b": 1}, waiting=[60])  # the next step it sheds like any keeper
    assert a.table.num_live < live + 1 and a.table.num_live >= a.keep(a.table.num_logical)


def test_pressure_scores_a_keepers_window_on_demand_only_when_the_pool_may_run_short():
    """Compactor.foresee: a decoding keeper (snapkv: scores on demand) records its queries and has its window scored
    only when the pool may run short; far from short, nothing, so keeping every token costs decode steps nothing.
    The window is scored at most once per ``slack`` (a block) of decode steps, and the shed that follows judges
    the keeper's tokens by those scores."""
    sim = KVSim(num_blocks=64, block_size=BS)
    policy = make_policy("snapkv", budget=0.25, sink=0, recent=0, interval=0)
    sim.add("r", prompt=24, policy=policy, pressure=True)
    sim.step({"r": 24})
    st = sim.core.states["r"]
    sim.core.receive_stats("r", {"attn_sum": np.ones(24)})  # the prompt's window
    sim.step({"r": 1})

    def foresee(waiting):
        return sim.core.foresee({"r": 1}, waiting, 0, 64, 16)

    free = sim.pool.get_num_free_blocks()
    assert foresee([]) == ([], {})  # 57 blocks free: nothing to record, nothing to score
    # 25 tokens in 7 blocks: the next 16 steps (the window) take 4 more blocks, the next one none.
    assert foresee([(free - 4) * BS]) == ([], {})  # short in more than 16 steps: not yet
    assert foresee([(free - 3) * BS]) == (["r"], {})  # short within a window's steps: record its queries
    record, score = foresee([(free + 1) * BS])  # short at the next step: score the window, once per block
    assert record == ["r"] and score == {"r": policy.needs}
    assert foresee([(free + 1) * BS]) == (["r"], {})
    for _ in range(BS - 1):
        sim.step({"r": 1})
    assert foresee([(free + 1) * BS])[1] == {}
    sim.step({"r": 1})
    assert foresee([(free + 1) * BS])[1] == {"r": policy.needs}  # a block of steps later: again
    # The window's scores are what the next shed ranks by: the lowest-scored tokens go, not the newest.
    n = st.table.physical_len + 1
    scores = np.ones(n)
    scores[5:13] = 0.0
    sim.core.receive_stats("r", {"attn_sum": scores})
    sim.step({"r": 1}, waiting=[(sim.pool.get_num_free_blocks() + 2) * BS])
    dead = np.flatnonzero(~st.table.live_mask()[:n])
    assert st.record.shed_at >= 0 and dead.size
    assert set(dead.tolist()) <= set(range(16))  # around the lowest scores (snapkv pools neighbours), not the newest
    sim.check()
