"""Recall's scoring (vtoken/kv/query_window.py score_with_parked, vtoken/kv/tier.py page boxes), no vLLM: the exact
path equals a plain softmax over the window's queries and the live and parked keys together; a page box holds every
key parked in its page, stays so when slots are freed and reused, and bounds every logit; the summary path finds
the exact path's top parked tokens where pages differ; on CUDA the same results (marked gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_query_window import BS, HEADS, KVH, LAYERS, D, caches, key, step

from vtoken.core.move_batch import MoveBatch
from vtoken.core.planner import to_global_slots
from vtoken.kv.kv_layout import LAYOUTS
from vtoken.kv.query_window import QueryWindow
from vtoken.kv.tier import KVTier

SCALE = 0.3


def setup(layout="cpu", seed=0, parked_blocks=(9, 10, 11, 12), live_blocks=(1, 2), device="cpu"):
    """A request with 8 live tokens (blocks ``live_blocks``) and 16 parked ones (parked from ``parked_blocks``)."""
    kv = [t.to(device) for t in caches(layout, seed)]
    tier = KVTier(64, kv, layout, BS, D)
    src = to_global_slots(np.arange(len(parked_blocks) * BS), list(parked_blocks), BS)
    slots = np.arange(3, 3 + src.size)  # tier slots 3..18: two pages of 32 would be one; PAGE is 32
    tier.park(kv, [], MoveBatch(src, slots))
    window = QueryWindow(2, kv, layout, BS, HEADS, D, window=4)
    row = window.row_of("r")
    g = torch.Generator().manual_seed(seed + 1)
    for t in range(3):
        q = torch.randn(LAYERS, 1, HEADS, D, generator=g).to(device)
        step(window, kv, [(row, 0, 5 + t)], q)
    window.scale = SCALE
    return kv, tier, window, row, list(live_blocks), src, slots


def reference(window, kv, layout, live_blocks, seq, parked_src) -> tuple[np.ndarray, np.ndarray]:
    """Plain float64 softmaxes: each window query over the live keys at or before it and every parked key."""
    n = int(min(window.count[0], window.window))
    ring = np.arange(window.count[0] - n, window.count[0]) % window.window
    live_slots = [live_blocks[s // BS] * BS + s % BS for s in range(seq)]
    live_total, parked_total = np.zeros(seq), np.zeros(len(parked_src))
    for layer, k_cache in enumerate(kv):
        keys = torch.stack([key(k_cache.cpu(), layout, s) for s in live_slots]).double()
        parked = torch.stack([key(k_cache.cpu(), layout, int(s)) for s in parked_src]).double()
        for j in ring:
            q = window.q[0, layer, j].cpu().double()
            pos = int(window.pos[0, j])
            for h in range(HEADS):
                kv_h = h // (HEADS // KVH)
                logits = torch.cat([keys[: pos + 1, kv_h] @ q[h], parked[:, kv_h] @ q[h]]) * SCALE
                w = torch.softmax(logits, 0).numpy()
                live_total[: pos + 1] += w[: pos + 1]
                parked_total += w[pos + 1 :]
    return live_total, parked_total


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_the_exact_path_is_one_softmax_over_live_and_parked_keys(layout):
    kv, tier, window, row, live, src, slots = setup(layout)
    got_live, got_parked = window.score_with_parked(row, live, 8, kv, tier, slots)
    want_live, want_parked = reference(window, kv, layout, live, 8, src)
    np.testing.assert_allclose(got_live, want_live, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_parked, want_parked, rtol=1e-4, atol=1e-5)


def test_a_page_box_bounds_every_key_parked_in_it_even_after_slots_are_freed_and_reused():
    kv, tier, window, row, live, src, slots = setup()
    tier.free(slots[:5])  # five tokens left the tier (restored, or freed for good)
    other = to_global_slots(np.arange(4), [4], BS)
    tier.park(kv, [], MoveBatch(other, slots[:4]))  # and four others were parked into their slots
    lo, hi = tier.boxes(np.array([0]))
    for layer, k_cache in enumerate(kv):
        held = np.flatnonzero(tier.held)
        keys = torch.stack([key(k_cache, "cpu", int(s)) for s in np.concatenate([other, src[5:]])]).float()
        assert held.tolist() == sorted(slots[:4].tolist() + slots[5:].tolist())
        assert torch.all(lo[layer][0] <= keys.amin(0) + 1e-6) and torch.all(hi[layer][0] >= keys.amax(0) - 1e-6)
        # rebuilt from the slots still held: as tight as their keys
        assert torch.allclose(lo[layer][0], keys.amin(0)) and torch.allclose(hi[layer][0], keys.amax(0))


def test_the_summary_finds_the_page_the_queries_point_at():
    """Two pages of parked keys, one pointing along the queries: the summary's candidates are that page's tokens
    and their scores are the exact path's (the other page scores 0); the exact path's top tokens are found."""
    kv = caches("cpu", 3)
    tier = KVTier(96, kv, "cpu", BS, D)
    window = QueryWindow(1, kv, "cpu", BS, HEADS, D, window=2)
    row = window.row_of("r")
    direction = torch.randn(D, generator=torch.Generator().manual_seed(4))
    for k_cache in kv:  # blocks 8..15: keys along -direction; 0..7: along +direction
        views = LAYOUTS["cpu"](k_cache, BS)
        for b in range(16):
            sign = 1.0 if b < 8 else -1.0
            views[0][b][..., :D] = sign * direction + 0.01 * torch.randn(BS, KVH, D)
    near = to_global_slots(np.arange(32), list(range(8)), BS)
    far = to_global_slots(np.arange(32), list(range(8, 16)), BS)
    tier.park(kv, [], MoveBatch(np.concatenate([far, near]), np.arange(64)))  # page 0: far, page 1: near
    q = direction.repeat(LAYERS, 1, HEADS, 1)
    step(window, kv, [(row, 0, 3)], q)
    window.scale = SCALE
    _, exact = window.score_with_parked(row, [0], 4, kv, tier, np.arange(64))
    _, summary = window.score_with_parked(row, [0], 4, kv, tier, np.arange(64), candidates=32)
    assert (summary[:32] == 0).all() and (summary[32:] > 0).all(), "the near page's tokens are the candidates"
    top = np.argsort(-exact)[:32]
    assert set(top.tolist()) == set(range(32, 64))
    assert tier.bytes_recalled == (64 + 32) * LAYERS * KVH * D * 4  # the exact pass read 64 keys, the summary 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_recall_scores_as_on_the_cpu():
    cpu = setup("flash")
    gpu = setup("flash", device="cuda")
    for candidates in (None, 8):
        a = cpu[2].score_with_parked(cpu[3], cpu[4], 8, cpu[0], cpu[1], cpu[6], candidates)
        b = gpu[2].score_with_parked(gpu[3], gpu[4], 8, gpu[0], gpu[1], gpu[6], candidates)
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
