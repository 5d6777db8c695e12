"""The scorer on REAL keys and queries: tiny-llama run in transformers (eager attention, so it returns its
softmax probabilities) over a prompt and decode steps, with tokens evicted between steps by a 4D mask. The
statistics the definition gives from those probabilities must equal what the fast scorer and its reference
compute from the model's post-RoPE Q and K, written into a paged cache in vLLM's CPU layout (through vLLM's
own cache-write kernel when it is installed) under a shuffled block table and compacted as vToken does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from vtoken.core.packing import kill_and_pack  # noqa: E402
from vtoken.core.planner import to_global_slots  # noqa: E402
from vtoken.core.token_table import TokenTable  # noqa: E402
from vtoken.kv.kv_layout import LAYOUTS  # noqa: E402
from vtoken.kv.mover import CpuMover  # noqa: E402
from vtoken.kv.scores import ATTN_HIST, ATTN_SUM, AttentionScorer, uniform_share  # noqa: E402
from vtoken.kv.scores_reference import TIE_RTOL, ReferenceScorer  # noqa: E402
from vtoken.models import model_path  # noqa: E402

PROMPT, DECODE, WINDOW, BS, NUM_BLOCKS = 150, 8, 16, 32, 16
EVICT = {3: [5, 9, 17, 30, 41, 63, 77, 99, 120], 6: [2, 50, 51, 52, 140, 151]}  # decode step -> logical victims


@pytest.fixture(scope="module")
def captured():
    """One teacher-forced forward: per layer the post-RoPE query [H, N, D], key [kvh, N, D] and the model's
    own attention probabilities [H, N, N]; plus which keys each row could see."""
    if not model_path("tiny-llama").exists():
        pytest.skip("tiny-llama is not prepared (vtoken models prepare)")
    from reference import load
    from transformers.models.llama import modeling_llama

    model = load(str(model_path("tiny-llama")))
    n = PROMPT + DECODE
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for step, victims in EVICT.items():
        allowed[PROMPT + step :, victims] = False  # evicted before the forward of decode step `step`
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    seen, orig = [], modeling_llama.eager_attention_forward

    def capture(module, query, key, value, attention_mask, scaling, **kw):
        out, probs = orig(module, query, key, value, attention_mask, scaling, **kw)
        seen.append((query[0].detach(), key[0].detach(), probs[0].detach().float(), scaling))
        return out, probs

    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    modeling_llama.eager_attention_forward = capture
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        modeling_llama.eager_attention_forward = orig
    return seen, allowed


def expected(seen, allowed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The definition, in logical positions: each observed row (the prompt's last WINDOW rows, then every
    decode row), in order, adds its probabilities summed over layers and heads to every key it attends to,
    and shifts in 'share above 1 / (keys it attends to)'."""
    n = allowed.shape[0]
    acc, hist, near = np.zeros(n), np.zeros(n, np.int64), np.zeros(n, bool)
    total = sum(p.shape[0] for _, _, p, _ in seen)
    for row in range(PROMPT - WINDOW, n):
        keys = allowed[row].numpy()
        w = sum(p[:, row, :].sum(0) for _, _, p, _ in seen).double().numpy()
        acc[keys] += w[keys]
        share, uniform = w[keys] / total, uniform_share(keys.sum())
        hist[keys] = (hist[keys] << 1) | (share > uniform)
        near[keys] |= np.abs(share - uniform) <= TIE_RTOL * uniform
    return acc, hist, near


def write_kv(kv: torch.Tensor, keys: torch.Tensor, slots: np.ndarray) -> None:
    """K [n, kvh, D] into vLLM's CPU layout, by vLLM's own kernel when present (V is never read: zeros)."""
    try:
        from vllm import _custom_ops as ops

        k_cache, v_cache = kv.view(kv.shape[0], kv.shape[1], BS * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, torch.zeros_like(keys), k_cache, v_cache, torch.as_tensor(slots), "vec")
    except (ImportError, AttributeError, RuntimeError):
        LAYOUTS["cpu"](kv, BS)[0][torch.as_tensor(slots // BS), torch.as_tensor(slots % BS)] = keys


def test_scores_from_real_kv_equal_the_models_own_attention(captured):
    check_real_kv(captured, AttentionScorer)


class OffByOne(AttentionScorer):
    _CAUSAL_SLACK = 1  # planted bug: every query also sees the key after it


def test_negative_control_off_by_one_fails_on_real_kv(captured):
    with pytest.raises(AssertionError):
        check_real_kv(captured, OffByOne)


def check_real_kv(captured, fast_cls) -> None:
    seen, allowed = captured
    kvh, d = seen[0][1].shape[0], seen[0][0].shape[-1]
    kv = [torch.zeros(NUM_BLOCKS, kvh, BS * 2 * d) for _ in seen]
    rng = np.random.default_rng(0)
    free = [int(b) for b in rng.permutation(NUM_BLOCKS)]
    table, blocks = TokenTable(BS), []
    scorers = [fast_cls(NUM_BLOCKS * BS, BS, "cpu", torch.device("cpu")), ReferenceScorer(NUM_BLOCKS * BS, BS, "cpu")]

    def forward(first: int, count: int, n_q: int) -> None:
        """Logical tokens [first, first + count) written and observed, as one step of the model runner."""
        old = table.physical_len
        table.append(count)
        while len(blocks) * BS < table.physical_len:
            blocks.append(free.pop())
        slots = to_global_slots(np.arange(old, table.physical_len), blocks, BS)
        for layer, (_, k, _, _) in zip(kv, seen):
            write_kv(layer, k[:, first : first + count].transpose(0, 1).contiguous(), slots)
        md = SimpleNamespace(
            query_start_loc=torch.tensor([0, count], dtype=torch.int32),
            seq_lens=torch.tensor([table.physical_len], dtype=torch.int32),
            block_table=torch.tensor([blocks + [free[0]]], dtype=torch.int32),
            max_seq_len=table.physical_len,
        )
        for s in scorers:
            s.reset_slots(torch.as_tensor(slots))
            s.begin_step([0], [n_q])
            for layer, (q, _, _, scale) in zip(kv, seen):
                s.observe(q[:, first : first + count].transpose(0, 1).contiguous(), layer, md, scale)
            s.end_step()

    forward(0, PROMPT, WINDOW)  # the prompt as one chunk, observed through its window
    for step in range(DECODE):
        if step in EVICT:
            packed = kill_and_pack(table, np.array(EVICT[step]), blocks, BS)
            assert len(packed.moves)
            CpuMover(BS).apply(kv, packed.moves, scorers[0].extra_tensors + scorers[1].extra_tensors)
            free += blocks[packed.plan.keep_blocks :]
            del blocks[packed.plan.keep_blocks :]
        forward(PROMPT + step, 1, 1)

    acc, hist, near = expected(seen, allowed)
    live = table.live_logical()
    assert live.size == PROMPT + DECODE - sum(map(len, EVICT.values()))
    assert not near[live].any()
    for s in reversed(scorers):  # the reference first: a failure then points at the fast path
        got = s.export(blocks, table.physical_len, (ATTN_SUM, ATTN_HIST))
        slots = table.slot_of[live]
        np.testing.assert_allclose(got[ATTN_SUM][slots], acc[live], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[ATTN_HIST][slots], hist[live])
    # the model's attention is far from uniform: the statistics carry information
    assert 0 < np.mean(hist[live] & 1) < 0.9
