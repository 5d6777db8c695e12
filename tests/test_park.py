"""Parking without vLLM (vtoken/core/park.py, vtoken/kv/tier.py): the tier's slot allocator, tokens parked and restored
byte for byte in every layout vToken moves (the CPU layout, CUDA's flash view, AMX's VNNI packing), a tier slot
one request leaves taken by another's parking in the same step (with the negative control that parks before it
fetches), and the joint window's statistics against a plain softmax over the parked and live keys."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kv_layout_sim import vnni_layout

from vtoken.core.move_batch import MoveBatch
from vtoken.core.park import Parked, TierSlots
from vtoken.core.policies import ATTN_HIST, ATTN_SUM
from vtoken.kv.kv_layout import LAYOUTS
from vtoken.kv.mover import CpuMover
from vtoken.kv.scores import AttentionScorer, uniform_share
from vtoken.kv.scores_reference import window_probs
from vtoken.kv.tier import KVTier
from vtoken.kv.worker_step import apply_kv_step

BS, D, HEADS, LAYERS, BLOCKS = 32, 16, 2, 3, 12  # VNNI packs V in groups of 16 elements


def test_tier_slots_hand_out_and_take_back_in_any_order():
    t = TierSlots(10)
    a, b = t.take(4), t.take(8)
    assert len(a) == 4 and len(b) == 6 and t.num_free == 0  # fewer when the tier is nearly full
    t.give(a[[2, 0]])
    t.check_integrity(np.concatenate([a[[1, 3]], b]))
    with pytest.raises(ValueError):
        t.give(np.arange(9))
    with pytest.raises(ValueError):
        t.check_integrity(np.concatenate([a, b]))  # a[0] and a[2] are free: they cannot be held too


def test_parked_keeps_order_and_forward():
    p = Parked()
    p.add(np.array([5, 9]), np.array([0, 1]), 3)
    p.add(np.array([2]), np.array([7]), 4)
    assert p.logical.tolist() == [5, 9, 2] and p.at_forward.tolist() == [3, 3, 4] and p.size == 3
    p.clear()
    assert p.size == 0


def caches(layout, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, HEADS, BS * 2 * D) if layout != "flash" else (BLOCKS, HEADS, BS, 2 * D)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def token(kv, layout, slot: int) -> torch.Tensor:
    """One token's K and V as [kv_heads, 2 * D], through the layout."""
    if not isinstance(layout, str):
        b, o = torch.tensor([slot // BS]), torch.tensor([slot % BS])
        return kv.view(-1)[layout.positions(kv, b, o)][0]
    views = LAYOUTS[layout](kv, BS)
    return torch.cat([v[slot // BS, slot % BS] for v in views], dim=-1)


@pytest.mark.parametrize("name", ["cpu", "flash", "vnni"])
def test_parked_tokens_come_back_byte_for_byte_in_every_layout(name):
    layout = vnni_layout(BS, D) if name == "vnni" else name
    dtype = torch.bfloat16 if name == "vnni" else torch.float32
    kv = caches(layout, dtype)
    stats = [torch.arange(BLOCKS * BS, dtype=torch.float32), torch.arange(BLOCKS * BS, dtype=torch.int64) * 3]
    tier = KVTier(16, kv, layout, BS, D, stats)
    src = np.array([3, 40, 41, 200])
    want = [[token(k, layout, s).clone() for s in src] for k in kv]
    want_stats = [t[torch.as_tensor(src)].clone() for t in stats]
    tier.park(kv, stats, MoveBatch(src, np.array([5, 0, 9, 2])))
    for k in kv:  # the pool's slots are reused for something else meanwhile
        k.zero_()
    for t in stats:
        t.zero_()
    dst = np.array([100, 101, 300, 7])
    back = MoveBatch(np.array([5, 0, 9, 2]), dst)
    tier.restore(kv, stats, back, tier.fetch(back))
    for k, w in zip(kv, want):
        for s, tok in zip(dst, w):
            assert torch.equal(token(k, layout, int(s)), tok)
    for t, w in zip(stats, want_stats):
        assert torch.equal(t[torch.as_tensor(dst)], w)


class ParksBeforeItFetches(KVTier):
    """Planted bug: ``fetch`` returns a handle and ``restore`` reads the tier only then, after this step's parking
    may have reused the slot (what a byte order that parks before it fetches would do)."""

    def fetch(self, batch):
        return batch

    def restore(self, kv_caches, extra, batch, fetched):
        super().restore(kv_caches, extra, batch, super().fetch(fetched))


def apply_step(tier, kv, park: MoveBatch, restore: MoveBatch, moves: MoveBatch):
    """The worker's byte order, the runner's own function (vtoken/kv/worker_step.py)."""
    apply_kv_step(CpuMover(BS, "cpu"), tier, kv, [], moves, park, restore)


@pytest.mark.parametrize("fetch_first", [True, False])
def test_a_tier_slot_freed_by_one_request_and_parked_into_by_another_in_the_same_step(fetch_first):
    kv = caches("cpu")
    tier = (KVTier if fetch_first else ParksBeforeItFetches)(4, kv, "cpu", BS, D)
    tier.park(kv, [], MoveBatch(np.array([10]), np.array([0])))  # request A parked slot 10 into tier slot 0
    a_token = token(kv[0], "cpu", 10).clone()
    b_token = token(kv[0], "cpu", 70).clone()
    # This step: A restores tier slot 0 into pool slot 33 while B parks pool slot 70 into the same tier slot 0,
    # and B's packing moves slot 71 into the hole at 70.
    apply_step(tier, kv, MoveBatch(np.array([70]), np.array([0])), MoveBatch(np.array([0]), np.array([33])),
               MoveBatch(np.array([71]), np.array([70])))  # fmt: skip
    restored, parked = token(kv[0], "cpu", 33), tier.kv[0][0]
    if fetch_first:
        assert torch.equal(restored, a_token) and torch.equal(parked, b_token)
    else:
        assert not torch.equal(restored, a_token)  # A got B's token: the order matters


def test_the_joint_window_equals_one_softmax_over_parked_and_live_keys():
    """Three layers of a request whose last chunk's 4 window queries see 40 live keys and 6 parked ones."""
    g = torch.Generator().manual_seed(3)
    kv = caches("cpu")
    scorer = AttentionScorer(BLOCKS * BS, BS, "cpu", torch.device("cpu"))
    tier = KVTier(8, kv, "cpu", BS, D, scorer.extra_tensors)
    blocks, seq, n_q, heads = [4, 9], 40, 4, 4
    live = np.array([blocks[s // BS] * BS + s % BS for s in range(seq)])
    tier_slots = np.array([6, 1, 3, 0, 7, 2])
    for t in tier.kv:  # the parked keys: whatever sits in those tier slots
        t.copy_(torch.randn(t.shape, generator=g))
    md = SimpleNamespace(seq_lens=torch.tensor([seq]), query_start_loc=torch.tensor([0, n_q]),
                         block_table=torch.tensor([blocks]))  # fmt: skip
    tier.begin([(0, n_q, tier_slots)])
    queries = [torch.randn(n_q, heads, D, generator=g) for _ in kv]
    for q, k in zip(queries, kv):
        tier.observe(q, k, md, 0.3)
    tier.end(scorer)
    # Reference: parked keys first (every query sees them), then the live keys in physical order.
    weights = 0
    for layer, (q, k) in enumerate(zip(queries, kv)):
        keys = torch.stack([token(k, "cpu", int(s))[:, :D] for s in live])
        parked = tier.kv[layer][torch.as_tensor(tier_slots)][:, :, :D]
        weights = weights + window_probs(q, torch.cat([parked, keys]), 0.3).sum(1)  # [n_q, 6 + 40]
    acc = weights.sum(0)
    got_live = scorer.acc[torch.as_tensor(live)].double()
    got_parked = tier.extra[0][torch.as_tensor(tier_slots)].double()
    assert torch.allclose(got_live, acc[6:], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_parked, acc[:6], rtol=1e-5, atol=1e-6)
    total, p = LAYERS * heads, len(tier_slots)
    hist = torch.zeros(p + seq, dtype=torch.int64)
    for j in range(n_q):  # query j sits at live position seq - n_q + j: it attends the parked keys and live 0..pos
        pos = seq - n_q + j
        attends = torch.arange(p + seq) <= p + pos
        hot = (weights[j] / total > uniform_share(p + pos + 1)).long()
        hist = torch.where(attends, (hist << 1) | hot, hist)
    assert torch.equal(scorer.hist[torch.as_tensor(live)], hist[p:])
    assert torch.equal(tier.extra[1][torch.as_tensor(tier_slots)], hist[:p])
    out = tier.export(tier_slots, (ATTN_SUM, ATTN_HIST))
    assert np.allclose(out["parked:attn_sum"], acc[:6].numpy(), rtol=1e-5)


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("attend", [True, False])
def test_the_last_chunk_attends_live_and_parked_keys_in_one_softmax(attend, sliced, monkeypatch):
    """Two requests in one forward; the second's last chunk (12 queries, 4 of them its window) runs with 6 parked
    tokens: every query of that chunk attends the parked keys and the live keys up to itself in one softmax, and
    its rows of the layer's output are rewritten with that; the first request's rows are left alone. Sliced: the
    parked keys stream in two at a time (online softmax). Negative control: a tier that does not attend leaves the
    kernel's rows, which differ from the reference."""
    if sliced:
        monkeypatch.setattr(KVTier, "MIN_SLICE", 2)
        monkeypatch.setattr(KVTier, "SLICE_BYTES", 1)
    g = torch.Generator().manual_seed(5)
    kv = caches("cpu")
    tier = KVTier(8, kv, "cpu", BS, D)
    tier.attend = attend
    for t in tier.kv:
        t.copy_(torch.randn(t.shape, generator=g))
    heads, chunk, n_q, seq = 4, 12, 4, 40
    blocks = [[1, 2], [4, 9]]
    live = np.array([blocks[1][s // BS] * BS + s % BS for s in range(seq)])
    tier_slots = np.array([6, 1, 3, 0, 7, 2])
    md = SimpleNamespace(seq_lens=torch.tensor([5, seq]), query_start_loc=torch.tensor([0, 5, 5 + chunk]),
                         block_table=torch.tensor(blocks))  # fmt: skip
    tier.begin([(1, n_q, tier_slots)])
    for layer, k in enumerate(kv):
        q = torch.randn(5 + chunk, heads, D, generator=g)
        kernel = torch.randn(5 + chunk, heads, D, generator=g)  # what the pool's kernel wrote
        output = kernel.clone()
        tier.observe(q, k, md, 0.3, output)
        keys = torch.stack([token(k, "cpu", int(s)) for s in live])  # [seq, kvh, 2D]
        parked = tier.kv[layer][torch.as_tensor(tier_slots)]
        allk = torch.cat([keys, parked])  # live first, then parked
        pos = torch.arange(seq - chunk, seq)
        mask = torch.cat([torch.arange(seq)[None, :] > pos[:, None], torch.zeros(chunk, 6, dtype=torch.bool)], 1)
        qg = q[5:].view(chunk, 2, 2, D)
        logits = torch.einsum("qkgd,skd->qkgs", qg, allk[..., :D]) * 0.3
        p = torch.softmax(logits.masked_fill(mask[:, None, None, :], float("-inf")), -1)
        want = torch.einsum("qkgs,skd->qkgd", p, allk[..., D:]).reshape(chunk, heads, D)
        assert torch.equal(output[:5], kernel[:5])
        if attend:
            assert torch.allclose(output[5:], want, atol=1e-5)
        else:
            assert torch.equal(output[5:], kernel[5:]) and not torch.allclose(output[5:], want, atol=1e-3)


def test_every_parked_token_losing_with_live_ones_is_one_clean_compaction():
    """The choice with the question where every parked token loses and live tokens lose too: the parked ones stay
    parked, the live losers are parked beside them, and nothing is killed twice. (A defect: the parked list was
    cleared before the live losers were told apart from it, so parked losers were killed a second time in the
    table, "kill of already-evicted tokens"; seen with prefix caching, where protected blocks leave the window
    few parked winners.) With a tier too small for the live losers, the oldest parked tokens make room, and
    what still does not fit dies."""
    from kvsim import SimPool

    from vtoken.core.compactor import Compactor
    from vtoken.core.policies import make_policy
    from vtoken.core.records import RequestRecord

    for capacity, parked_after, died in ((64, 16, 0), (8, 8, 8)):
        bs, pool, blocks = 4, SimPool(16), []
        core = Compactor("vtoken", bs, pool, lambda rid, blocks=blocks: blocks, TierSlots(capacity))
        st = core.add("r", RequestRecord("r", 0), make_policy("h2o", budget=8, sink=0, recent=0), prefill_len=24)
        st.table.append(24)
        blocks += pool.get_new_blocks(6)
        core.evict(st, np.arange(4, 12), park=True)  # a chunk boundary parks 8 tokens
        assert st.parked.size == 8 and st.table.num_live == 16
        core.step += 1
        live_slots = st.table.slot_of[st.table.live_logical()]
        score = np.zeros(bs * len(blocks))
        score[live_slots] = np.arange(16, dtype=float)  # live: the 8 lowest lose
        stats = {ATTN_SUM: score, f"parked:{ATTN_SUM}": np.full(8, -1.0)}  # parked: every one loses
        core._choose_with_parked(st, stats)
        assert st.table.num_live == 8 and st.table.live_logical().tolist() == list(range(16, 24))
        assert st.parked.size == parked_after and core.tier.num_free == capacity - parked_after
        # a full tier freed the oldest parked tokens (4..11, parked first) for the live losers (0..3, 12..15)
        assert sorted(st.parked.logical.tolist()) == (list(range(0, 16)) if capacity == 64 else
                                                       [0, 1, 2, 3, 12, 13, 14, 15])  # fmt: skip
        assert len(st.record.trace()["evicted_positions"]) == died
        core.check_integrity()


def test_the_tier_is_sized_from_host_memory_on_a_gpu(monkeypatch):
    from vtoken import config as config_mod
    from vtoken.config import VTokenConfig

    monkeypatch.setattr(config_mod, "host_memory_bytes", lambda: 64 << 30)
    cfg = VTokenConfig()
    assert cfg.tier_tokens(10_000, "cpu") == 40_000  # a CPU pool is host memory already: four times its tokens
    per_token = 128 << 10  # Llama-3.1-8B: 32 layers x 8 kv heads x 128 x 2 (K, V) x 2 bytes
    assert cfg.tier_tokens(10**6, "cuda", per_token) == (16 << 30) // per_token  # a quarter of 64 GiB
    assert cfg.tier_tokens(10**6, "cuda", per_token, ranks=2) == (8 << 30) // per_token  # shared by two ranks
    assert cfg.tier_tokens(1_000, "cuda", per_token) == 4_000  # never more than four pools
    assert VTokenConfig(park_host_memory=0.5).tier_tokens(10**6, "cuda", per_token) == (32 << 30) // per_token
    assert VTokenConfig(park_tokens=77).tier_tokens(10**6, "cuda", per_token) == 77
    assert VTokenConfig(park_tokens=0).tier_tokens(10**6, "cuda", per_token) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_tier_is_pinned_host_memory_and_agrees_with_the_cpu():
    """The same parks, fetches and restores, and the same last chunk, on CUDA caches (tier in pinned host memory,
    copies on a side stream) and on CPU caches: byte-identical moves, outputs within float tolerance."""
    runs = {}
    for device in ("cpu", "cuda"):
        kv = [t.to(device) for t in caches("flash")]
        tier = KVTier(16, kv, "flash", BS, D)
        assert tier.kv[0].device.type == "cpu" and tier.kv[0].is_pinned() == (device == "cuda")
        tier.park(kv, [], MoveBatch(np.array([3, 40, 41, 200]), np.array([5, 0, 9, 2])))
        for k in kv:
            k.zero_()
        back = MoveBatch(np.array([5, 0, 9, 2]), np.array([100, 101, 300, 7]))
        tier.restore(kv, [], back, tier.fetch(back))
        md = SimpleNamespace(seq_lens=torch.tensor([40]), query_start_loc=torch.tensor([0, 12]),
                             block_table=torch.tensor([[4, 9]]))  # fmt: skip
        tier.begin([(0, 4, np.array([5, 0, 9]))])
        g = torch.Generator().manual_seed(1)
        q = torch.randn(12, 4, D, generator=g).to(device)
        out = torch.zeros(12, 4, D, device=device)
        tier.observe(q, kv[0], md, 0.3, out)
        torch.cuda.synchronize()
        runs[device] = ([k.cpu() for k in kv], out.cpu())
    assert all(torch.equal(a, b) for a, b in zip(runs["cpu"][0], runs["cuda"][0]))
    assert torch.allclose(runs["cpu"][1], runs["cuda"][1], atol=1e-4)
