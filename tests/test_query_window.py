"""The on-demand window of recent queries (vtoken/kv/query_window.py): what it scores equals a plain softmax over the
same queries and keys, in vLLM's CPU layout and CUDA's flash view; the ring keeps the last W queries; a window
starts afresh after a decision; buffers keep their addresses, so a CUDA graph can write them (marked gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.kv.kv_layout import LAYOUTS
from vtoken.kv.query_window import QueryWindow

BS, D, KVH, HEADS, LAYERS, BLOCKS = 4, 8, 2, 4, 3, 16


def caches(layout: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, KVH, BS * 2 * D) if layout == "cpu" else (BLOCKS, KVH, BS, 2 * D)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


def key(kv: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    """One token's K [kvh, D] through the layout's views."""
    views = LAYOUTS[layout](kv, BS)
    return views[0][slot // BS, slot % BS][..., :D]


def reference(queries, positions, kv, layout, blocks, seq, scale) -> np.ndarray:
    """Every query head's softmax over the keys at or before its query, summed over heads, queries and layers."""
    slots = [blocks[s // BS] * BS + s % BS for s in range(seq)]
    total = torch.zeros(seq, dtype=torch.float64)
    for layer, k_cache in enumerate(kv):
        keys = torch.stack([key(k_cache, layout, s) for s in slots]).double()  # [seq, kvh, D]
        for q_all, pos in zip(queries, positions):
            q = q_all[layer].double()  # [H, D]
            for h in range(HEADS):
                logits = keys[: pos + 1, h // (HEADS // KVH)] @ q[h] * scale
                total[: pos + 1] += torch.softmax(logits, 0)
    return total.numpy()


def step(window: QueryWindow, kv, rows_tokens: list[tuple[int, int, int]], queries: torch.Tensor) -> None:
    """One forward: ``rows_tokens`` (buffer row, token index, position); ``queries`` [layers, tokens, H, D]."""
    window.begin(rows_tokens)
    for layer, k_cache in enumerate(kv):
        window.record(queries[layer], k_cache, None, 0.3)


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_the_window_scores_like_a_plain_softmax_over_the_same_queries_and_keys(layout):
    g = torch.Generator().manual_seed(7)
    kv = caches(layout)
    window = QueryWindow(4, kv, layout, BS, HEADS, D, window=3)
    a, b = window.row_of("a"), window.row_of("b")
    blocks = {"a": [5, 2, 9], "b": [1, 7]}
    seen = {"a": [], "b": []}
    for t in range(5):  # five decode steps, two requests in one forward (b first)
        q = torch.randn(LAYERS, 2, HEADS, D, generator=g)
        pos = {"a": 6 + t, "b": 3 + t}
        step(window, kv, [(b, 0, pos["b"]), (a, 1, pos["a"])], q)
        seen["b"].append((q[:, 0], pos["b"]))
        seen["a"].append((q[:, 1], pos["a"]))
    for rid, row in (("a", a), ("b", b)):
        seq = seen[rid][-1][1] + 1
        got = window.score(row, blocks[rid], seq, kv)
        last = seen[rid][-3:]  # the ring keeps the last three
        want = reference([x[0] for x in last], [x[1] for x in last], kv, layout, blocks[rid], seq, 0.3)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(
            got, reference([x[0] for x in seen[rid]], [x[1] for x in seen[rid]], kv, layout, blocks[rid], seq, 0.3)
        ), "five queries score otherwise: the ring really keeps three"


def test_a_window_starts_afresh_after_a_decision_and_a_released_row_is_reused():
    kv = caches("cpu")
    window = QueryWindow(2, kv, "cpu", BS, HEADS, D, window=4)
    row = window.row_of("a")
    step(window, kv, [(row, 0, 3)], torch.randn(LAYERS, 1, HEADS, D))
    assert window.score(row, [0, 1], 4, kv).sum() > 0
    window.clear(row)
    assert window.score(row, [0, 1], 4, kv).sum() == 0  # nothing since the decision
    assert window.row_of("b") != row and window.row_of("c") is None  # two rows only
    window.release("a")
    assert window.row_of("c") == row


def test_buffers_keep_their_addresses_step_after_step():
    kv = caches("flash")
    window = QueryWindow(3, kv, "flash", BS, HEADS, D, window=2)
    before = [window.q.data_ptr(), window.pos.data_ptr(), window._idx.data_ptr()]
    rows = [window.row_of(r) for r in "abc"]
    for t in range(5):
        step(window, kv, [(r, i, 5 + t) for i, r in enumerate(rows[: 1 + t % 3])], torch.randn(LAYERS, 3, HEADS, D))
    assert [window.q.data_ptr(), window.pos.data_ptr(), window._idx.data_ptr()] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_cuda_graph_writes_the_window_in_place():
    kv = [t.cuda() for t in caches("flash")]
    window = QueryWindow(2, kv, "flash", BS, HEADS, D, window=4)
    row = window.row_of("a")
    q = torch.zeros(LAYERS, 1, HEADS, D, device="cuda")
    window.begin([(row, 0, 7)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer, k in enumerate(kv):
            window.record(q[layer], k, None, 0.3)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer, k in enumerate(kv):
            window.record(q[layer], k, None, 0.3)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(window.q[row, :, 0].float(), q[:, 0].float())
