"""A paged-attention stack (PyTorch only) that reads the slots the fused mover has just written: eager on CPU, and
(marked gpu) captured as a CUDA graph with the per-layer waits inside, against an eager reference, with a planted
graph that lacks the waits. Imports no vLLM: the GPU machine has none."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from vtoken.bench.attention_stack import PagedStack, Shapes  # noqa: E402
from vtoken.core.move_batch import MoveBatch  # noqa: E402
from vtoken.kv.fused_mover import FusedMover  # noqa: E402
from vtoken.kv.mover import ReferenceMover, graph_safe_events  # noqa: E402


def test_attention_stack_runs_on_cpu_and_waits_before_each_cache_write():
    s = Shapes(layers=3, heads=4, kv_heads=2, head_size=16, hidden=64, ffn=128)
    stack = PagedStack(s, batch=3, context=20, block_size=8, dtype=torch.float32, device="cpu")
    before = [kv.transpose(1, 2)[stack._where].clone() for kv in stack.kv]  # the slots this step writes
    order = []

    def wait(i):  # layer i's wait comes before layer i writes its cache, and after layer i - 1 wrote its own
        assert torch.equal(stack.kv[i].transpose(1, 2)[stack._where], before[i])
        assert i == 0 or not torch.equal(stack.kv[i - 1].transpose(1, 2)[stack._where], before[i - 1])
        order.append(i)

    stack.step(wait)
    assert order == [0, 1, 2] and torch.isfinite(stack.out).all()
    # Layer 0's K and V, computed here from the step's input, landed exactly at slot_mapping.
    w_qkv = stack.w[0][0]
    _, k, v = (F.rms_norm(stack.x, (s.hidden,)) @ w_qkv).split(
        [s.heads * s.head_size, s.kv_heads * s.head_size, s.kv_heads * s.head_size], -1
    )
    want = torch.cat([k.view(3, s.kv_heads, -1), v.view(3, s.kv_heads, -1)], -1)
    assert torch.allclose(stack.kv[0].transpose(1, 2)[stack._where], want)


# ---------------------------------------------------------------------------------------------- CUDA
SMALL = Shapes(layers=4, heads=4, kv_heads=2, head_size=64, hidden=256, ffn=512)


def _moves(stack, step: int) -> MoveBatch:
    """Request 0's tokens overwrite request 1's (so request 1's output depends on the moves), and on the second
    step request 1's first block goes to request 2 while request 1 receives: slots both read and written."""
    per = stack.blocks_per_req * stack.block_size
    n = stack.context // 2
    src, dst = np.arange(n), per + np.arange(n)
    if step == 1:
        src = np.concatenate([src, per + np.arange(stack.block_size)])
        dst = np.concatenate([dst, 2 * per + np.arange(stack.block_size)])
    return MoveBatch(src.astype(np.int64), dst.astype(np.int64))


def _graph_against_eager(wait_in_graph: bool) -> list[bool]:
    stack = PagedStack(SMALL, batch=3, context=40, block_size=16, dtype=torch.float32)
    ref = PagedStack(SMALL, batch=3, context=40, block_size=16, dtype=torch.float32)
    mover = FusedMover(16, "flash", "cuda", group_sizes=[1, 1, 2])
    mover.bind(stack.kv)
    graph = stack.capture(mover.wait_layer if wait_in_graph else None)
    agree = []
    for step in range(2):
        batch = _moves(stack, step)
        with torch.cuda.stream(mover.stream):
            torch.cuda._sleep(100_000_000)  # ~50 ms late: a forward that does not wait reads the old slots
        mover.apply(stack.kv, batch)  # eager, on the side stream, outside the graph
        graph.replay()
        ReferenceMover(16, "flash").apply(ref.kv, batch)
        ref.step()
        torch.cuda.synchronize()
        agree.append(torch.allclose(stack.out, ref.out, atol=1e-4, rtol=1e-4))
    return agree


@pytest.mark.gpu
def test_captured_attention_stack_reads_the_slots_the_mover_just_wrote():
    assert graph_safe_events(), "this torch cannot wait on outside events inside a CUDA graph"
    assert _graph_against_eager(wait_in_graph=True) == [True, True]


@pytest.mark.gpu
def test_negative_control_a_graph_without_the_waits_reads_stale_slots():
    assert _graph_against_eager(wait_in_graph=False)[0] is False
