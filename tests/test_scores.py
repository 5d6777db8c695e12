"""The fast AttentionScorer against its plain reference (vtoken/kv/scores_reference.py) on random KV in both
layouts: several requests of different lengths in one batch, prefill chunks observed through their windows
and decode rows through their one query, unobserved rows between them, eviction and compaction between
steps. Planted bugs prove the comparison can fail. GPU variants run on CUDA (scripts/gpu_check.sh)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_layout_sim import vnni_layout
from scores_sim import Req, ScoreSim, assert_same_stats, batch

from vtoken.core.policies import ATTN_HIST, ATTN_SUM, PolicyInput, make_policy
from vtoken.kv.scores import AttentionScorer, uniform_share
from vtoken.kv.scores_reference import NEAR_TIE, ReferenceScorer, window_probs


def run(fast_cls=AttentionScorer, steps=9, evict=0.2, layout="cpu", device="cpu", dtype=torch.float32, **kw):
    if layout == "vnni":  # vLLM's CPU layout with AMX (bf16): no strided view, a learned table
        layout = vnni_layout(kw.get("block_size", 16), kw.get("head_size", 32))
    sim = ScoreSim([], batch(), layout=layout, device=device, dtype=dtype, **kw)
    num_slots = sim.kv[0].shape[0] * sim.bs
    fast = fast_cls(num_slots, sim.bs, layout, torch.device(device))
    ref = ReferenceScorer(num_slots, sim.bs, layout)
    sim.scorers = [fast, ref]
    for i in range(steps):
        sim.step(evict=evict if i % 2 else 0.0)
    return sim, fast, ref


@pytest.mark.parametrize("layout", ["cpu", "flash", "vnni"])
def test_fast_scorer_equals_reference_with_compaction(layout):
    sim, fast, ref = run(layout=layout)
    assert sum(len(r.blocks) for r in sim.reqs) < sum(-(-r.table.num_logical // sim.bs) for r in sim.reqs)
    assert all(r.table.num_live < r.table.num_logical for r in sim.reqs if r.prompt > 1)  # tokens were evicted
    assert_same_stats(sim, fast, ref)


class ByBlock(AttentionScorer):
    """The path of steps with a lot of K (_score_by_block), on the small KV of these tests."""

    _ROWS_BYTES = 0


class LayerByLayer(AttentionScorer):
    """One layer per softmax (the path of long prefill windows), on the small KV of these tests."""

    _GROUP_BYTES = 0


@pytest.mark.parametrize("fast_cls", [ByBlock, LayerByLayer])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_by_block_and_layer_by_layer_paths_equal_the_reference(fast_cls, dtype):
    sim, fast, ref = run(fast_cls=fast_cls, dtype=dtype, steps=7)
    assert_same_stats(sim, fast, ref)


class Spy(AttentionScorer):
    """Counts the layers whose queries were taken as they are, without a gather."""

    whole_layers = 0

    def observe(self, query, kv_cache, attn_metadata, scale):
        super().observe(query, kv_cache, attn_metadata, scale)
        if self._rows.size and self._plan.whole:
            self.whole_layers += 1


@pytest.mark.parametrize("layout", ["cpu", "vnni"])
def test_a_step_of_decode_rows_takes_the_layers_queries_as_vllm_hands_them_over(layout):
    """Every request observed: once all are decoding, every token of the forward is an observed query and the
    scorer reads the layers' queries where they lie (strided views into the qkv projection, as in vLLM)."""
    if layout == "vnni":
        layout = vnni_layout(16, 32)
    reqs = [Req(prompt=200, chunk=96, window=4), Req(prompt=1, chunk=1, window=1), Req(prompt=300, chunk=128, window=8)]
    sim = ScoreSim([], reqs, layout=layout, qkv_view=True)
    num_slots = sim.kv[0].shape[0] * sim.bs
    fast, ref = Spy(num_slots, sim.bs, layout, torch.device("cpu")), ReferenceScorer(num_slots, sim.bs, layout)
    sim.scorers = [fast, ref]
    for i in range(8):
        sim.step(evict=0.2 if i % 2 else 0.0)
    assert fast.whole_layers == 5 * sim.layers  # the decode steps: after the three chunks of the longest prompt
    assert_same_stats(sim, fast, ref)


@pytest.mark.parametrize("layout", ["cpu", "flash", "vnni"])
def test_bf16_kv_is_scored_in_fp32(layout):
    sim, fast, ref = run(layout=layout, dtype=torch.bfloat16, steps=5)
    assert_same_stats(sim, fast, ref)


def test_the_same_eviction_decisions():
    """H2O and Scissorhands pick the same victims from the fast statistics as from the reference's."""
    sim, fast, ref = run(steps=11)
    for r, a, b in zip(sim.reqs, sim.stats(fast), sim.stats(ref, (ATTN_SUM, ATTN_HIST, NEAR_TIE))):
        if not r.observed or r.table.num_live < 12:
            continue
        live = r.table.live_logical()
        keep = dict(budget=live.size // 2, sink=2, recent=4)  # half the live tokens must go
        for policy, name in ((make_policy("h2o", **keep), ATTN_SUM), (make_policy("scissorhands", **keep), ATTN_HIST)):
            pick = [policy.select(PolicyInput(r.table.num_logical, 3, live, {name: s[name]})) for s in (a, b)]
            assert pick[0].size and np.array_equal(pick[0], pick[1])


class OffByOne(AttentionScorer):
    """Planted bug: each query also attends to the key just after it (the causal limit off by one)."""

    _CAUSAL_SLACK = 1


def test_negative_control_off_by_one_causal_limit_is_caught():
    sim, fast, ref = run(fast_cls=OffByOne, steps=5, evict=0.0)
    with pytest.raises(AssertionError):
        assert_same_stats(sim, fast, ref)


def test_negative_control_unmoved_statistics_are_caught():
    """Statistics that do not travel with their tokens (the mover not given extra_tensors) disagree."""
    sim, fast, ref = run(steps=4)
    moved = fast.extra_tensors
    fast.acc, fast.hist = fast.acc.clone(), fast.hist.clone()  # the mover now moves copies
    sim.step(evict=0.3)
    fast.acc, fast.hist = moved
    with pytest.raises(AssertionError):
        assert_same_stats(sim, fast, ref)


def test_window_probs_is_causal_softmax():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    p = window_probs(q, k, 0.5)
    assert torch.allclose(p.sum(-1), torch.ones(3, 4, dtype=torch.float64))
    assert (p[0, :, 8:] == 0).all() and (p[1, :, 9:] == 0).all() and (p[2] > 0).all()
    dense = torch.softmax((q[2] @ k[:, [0, 0, 1, 1]].permute(1, 2, 0) * 0.5)[range(4), range(4)].double(), -1)
    assert torch.allclose(p[2], dense)
    assert uniform_share(10) == 0.1


def test_nothing_observed_means_no_exchange_and_no_change():
    class CountingTP:
        world, calls = 1, 0

        def sum_scores(self, w):
            CountingTP.calls += 1
            return w

    sim = ScoreSim([], batch())
    fast = AttentionScorer(sim.kv[0].shape[0] * sim.bs, sim.bs, "cpu", torch.device("cpu"), CountingTP())
    fast.end_step()  # no begin_step at all
    fast.begin_step([], [])
    fast.observe(torch.zeros(3, 4, 32), sim.kv[0], None, 1.0)
    fast.end_step()
    assert CountingTP.calls == 0 and not fast.acc.any() and not fast.hist.any()
    with pytest.raises(ValueError):
        fast.begin_step([0, 1], [1])
    with pytest.raises(ValueError):
        fast.begin_step([0], [0])


def test_rows_asked_for_more_queries_than_they_have_are_refused():
    sim = ScoreSim([], batch())
    fast = AttentionScorer(sim.kv[0].shape[0] * sim.bs, sim.bs, "cpu", torch.device("cpu"))
    sim.scorers = [fast]
    sim.step()
    fast.begin_step([1], [2])  # request 1 decodes now: one query
    with pytest.raises(ValueError, match="more queries"):
        fast.observe(torch.zeros(200, 4, 32), sim.kv[0], sim._metadata([32, 1, 45, 64]), 1.0)


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_flash_layout_equals_reference(dtype):
    sim, fast, ref = run(layout="flash", device="cuda", dtype=dtype)
    assert fast.acc.is_cuda
    assert_same_stats(sim, fast, ref)


@pytest.mark.gpu
def test_cuda_step_never_waits_for_the_device():
    """reset_slots, begin_step, observe and end_step only queue work: no host synchronisation (export may)."""
    sim, fast, _ = run(layout="flash", device="cuda", steps=3)
    sim.scorers = [fast]

    def no_sync(fn):
        def checked(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises instead of waiting
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        return checked

    for name in ("reset_slots", "begin_step", "observe", "end_step"):
        setattr(fast, name, no_sync(getattr(fast, name)))
    torch.cuda.synchronize()
    sim.step()
    sim.step(evict=0.2)


def test_negative_control_a_table_layout_read_as_the_vec_view_is_caught():
    """vLLM's AMX layout scored as if it were the vec kernel's (what vToken did before it learned layouts)."""
    layout = vnni_layout(16, 32)
    sim = ScoreSim([], batch(), layout=layout)
    num_slots = sim.kv[0].shape[0] * sim.bs
    fast = AttentionScorer(num_slots, sim.bs, "cpu", torch.device("cpu"))
    ref = ReferenceScorer(num_slots, sim.bs, layout)
    sim.scorers = [fast, ref]
    for i in range(5):
        sim.step(evict=0.2 if i % 2 else 0.0)
    with pytest.raises(AssertionError):
        assert_same_stats(sim, fast, ref)
