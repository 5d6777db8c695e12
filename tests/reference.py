"""An independent reference for evicting generation: plain transformers Llama, one teacher-forced forward
with a per-row 4D mask that hides exactly the tokens the eviction trace says were dead at that step.

Row ``P - 1 + j`` (the forward that produced output token ``j``) may attend key ``k`` iff ``k <= row`` and
``k`` was not evicted at a decode step ``<= j``. Nothing here imports vToken.
"""

from __future__ import annotations

import numpy as np
import torch


def load(model_dir: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="eager")
    return model.eval()


def masked_logprobs(
    model, prompt: list[int], output: list[int], evicted_pos: list[int], evicted_step: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and log-probabilities of ``output`` under the eviction trace."""
    ids = torch.tensor([prompt + output[:-1]])
    n = ids.shape[1]
    p = len(prompt)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for pos, step in zip(evicted_pos, evicted_step):
        rows = np.arange(p - 1 + step, n)  # from the forward that produced output token `step` on
        allowed[rows, pos] = False
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(1, 1, n, n, dtype=dtype)
    mask[0, 0][~allowed] = torch.finfo(dtype).min
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[0].float()
    lp = torch.log_softmax(logits[p - 1 :], dim=-1)
    out = torch.tensor(output)
    return lp.argmax(-1).numpy(), lp[torch.arange(len(output)), out].numpy()
