"""An independent reference for evicting generation: plain transformers Llama, teacher-forced forwards with a
per-row 4D mask that hides exactly the keys the eviction trace says were dead for that row's forward.

A run of a request executes forwards 0, 1, 2, ...: its prefill chunks (``prefill_chunks``, after any
prefix-cached tokens; they cover the prompt and, after a preemption, the outputs sampled so far), then one
decode step per further output token. Row ``i`` of the teacher-forced sequence (prompt + output[:-1]) belongs to
the forward that computed token ``i``; it may attend key ``k`` iff ``k <= i`` and ``k`` was not evicted at a
forward ``<=`` its own (``evicted_at_forward``), nor parked then (a token parked and restored,
``restored_positions``, is hidden from the forwards in ``[parked_at_forward, restored_at_forward)``, once for each
time it was parked and restored), except that
parking's last chunk (``joint_forward``) attends every token parked then (``joint_positions``) as well. A
preempted request has several runs (``preempted_runs``, then the trace's own fields); output token ``j`` is
checked against the run that sampled it. Nothing here imports vToken.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

# fp8 formats of vLLM's kv_cache_dtype: (torch dtype, mantissa bits, smallest normal exponent)
FP8 = {
    "fp8": (torch.float8_e4m3fn, 3, -6),
    "fp8_e4m3": (torch.float8_e4m3fn, 3, -6),
    "fp8_e5m2": (torch.float8_e5m2, 2, -14),
}


def load(model_dir: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="eager")
    return model.eval()


def fp8_as_stored(x: torch.Tensor, kv_cache_dtype: str, scale: float = 1.0) -> torch.Tensor:
    """``x`` as vLLM's CPU attention reads it back from an fp8 cache: stored as ``x / scale`` clamped to the format's
    largest value and cut toward zero to the format's precision (its mantissa bits; subnormals below the smallest
    normal exponent), read as that times ``scale``. Written from the format's definition, not from vToken's code."""
    fp8, mant, emin = FP8[kv_cache_dtype]
    y = (x.float() / scale).clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max)
    _, e = torch.frexp(y)  # |y| = f * 2**e, f in [0.5, 1): its leading bit is 2**(e - 1)
    step = torch.exp2((torch.clamp(e - 1, min=emin) - mant).float())
    return (torch.trunc(y / step) * step * scale).to(x.dtype)


@contextlib.contextmanager
def kv_stored_as(kv_cache_dtype: str | None):
    """The reference model's attention reads every key (after RoPE) and value as an fp8 cache would store it
    (``fp8_as_stored``); None or "auto": unchanged."""
    if kv_cache_dtype in (None, "auto"):
        yield
        return
    from transformers.models.llama import modeling_llama as ml

    eager = ml.eager_attention_forward

    def quantised(module, query, key, value, *args, **kwargs):
        return eager(module, query, fp8_as_stored(key, kv_cache_dtype), fp8_as_stored(value, kv_cache_dtype), *args,
                     **kwargs)  # fmt: skip

    ml.eager_attention_forward = quantised
    try:
        yield
    finally:
        ml.eager_attention_forward = eager


def runs(trace: dict) -> list[dict]:
    return [*trace.get("preempted_runs", []), trace]


def row_forwards(run: dict, prompt_len: int, n_rows: int) -> np.ndarray:
    """The forward of the run that computed each row (prefix-cached rows: -1, computed by another request)."""
    read = prompt_len + run.get("outputs_at_start", 0)
    cached = run.get("prefix_cached_tokens", 0)
    chunks = run.get("prefill_chunks") or [read - cached]
    assert cached + sum(chunks) == read, f"prefill chunks {chunks} + {cached} cached tokens are not {read} tokens"
    rows = [np.full(cached, -1)] + [np.full(c, f) for f, c in enumerate(chunks)]
    rows.append(np.arange(len(chunks), len(chunks) + max(n_rows - read, 0)))  # decode forwards: a row each
    return np.concatenate(rows).astype(np.int64)[:n_rows]


def allowed_mask(run: dict, prompt_len: int, n_rows: int, late: int = 0, joint: bool = True) -> np.ndarray:
    """[rows, keys] bool. ``late``: negative control, apply every prefill-boundary eviction that many forwards
    late (the rows of the chunk right after the boundary still see the evicted keys). ``joint``: the rows of the
    trace's ``joint_forward`` (parking's last chunk) also see its ``joint_positions`` (False: a negative control
    that ignores them)."""
    fwd = row_forwards(run, prompt_len, n_rows)
    died = np.full(n_rows, np.iinfo(np.int64).max)
    pos = np.asarray(run["evicted_positions"], dtype=np.int64)
    at = np.asarray(run["evicted_at_forward"], dtype=np.int64)
    if late:
        at = np.where(at <= len(run.get("prefill_chunks") or [0]), at + late, at)
    died[pos] = at
    allowed = np.tril(np.ones((n_rows, n_rows), dtype=bool)) & (fwd[:, None] < died[None, :])
    # Parked, then restored: hidden from the forward that parked them up to the one that restored them.
    back = np.asarray(run.get("restored_positions", []), dtype=np.int64)
    if back.size:
        parked = np.asarray(run["parked_at_forward"], dtype=np.int64)
        restored = np.asarray(run["restored_at_forward"], dtype=np.int64)
        hidden = (fwd[:, None] >= parked[None, :]) & (fwd[:, None] < restored[None, :])
        # A token parked and restored more than once (recall while decoding) has one entry per time: every
        # interval hides it (a fancy-indexed &= with repeated columns would keep only the last one).
        uniq, inv = np.unique(back, return_inverse=True)
        times = np.zeros((uniq.size, n_rows), dtype=np.int64)
        np.add.at(times, inv, hidden.T.astype(np.int64))
        allowed[:, uniq] &= (times == 0).T
    if joint and run.get("joint_forward", -1) >= 0:  # parking's last chunk attended the parked tokens too
        rows = fwd == run["joint_forward"]
        seen = np.asarray(run["joint_positions"], dtype=np.int64)
        allowed[np.ix_(rows, seen)] = True
        allowed &= np.tril(np.ones((n_rows, n_rows), dtype=bool))
    return allowed


def masked_logprobs(
    model, trace: dict, late: int = 0, joint: bool = True, kv_cache_dtype: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and log-probabilities of the trace's output tokens under its eviction trace, with keys and
    values read as a ``kv_cache_dtype`` cache stores them."""
    prompt, output = trace["prompt_token_ids"], trace["output_token_ids"]
    ids = torch.tensor([prompt + output[:-1]])
    p, n = len(prompt), ids.shape[1]
    dtype = next(model.parameters()).dtype
    greedy, lps = np.zeros(len(output), np.int64), np.zeros(len(output))
    every = runs(trace)
    for i, run in enumerate(every):
        first = run.get("outputs_at_start", 0)
        last = every[i + 1].get("outputs_at_start", 0) if i + 1 < len(every) else len(output)
        if last <= first:
            continue
        allowed = torch.from_numpy(allowed_mask(run, p, n, late, joint))
        mask = torch.zeros(1, 1, n, n, dtype=dtype)
        mask[0, 0][~allowed] = torch.finfo(dtype).min
        with torch.no_grad(), kv_stored_as(kv_cache_dtype):
            logits = model(input_ids=ids, attention_mask=mask).logits[0].float()
        lp = torch.log_softmax(logits[p - 1 + first : p - 1 + last], dim=-1)
        out = torch.tensor(output[first:last])
        greedy[first:last] = lp.argmax(-1).numpy()
        lps[first:last] = lp[torch.arange(last - first), out].numpy()
    return greedy, lps
