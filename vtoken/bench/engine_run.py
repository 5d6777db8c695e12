"""Shared benchmark plumbing: one vLLM engine per mode, the same prompts, timed generation, vToken stats."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass
class ModeRun:
    label: str
    seconds: float
    output_tokens: int
    requests: list[dict] = field(default_factory=list)
    engine: dict = field(default_factory=dict)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_mode(model_dir: str, label: str, vtoken: dict, prompts: list[list[int]], max_tokens: int,
             dtype: str = "float32", kv_bytes: int = 1 << 30, max_model_len: int = 8192, **kw) -> ModeRun:
    """Generate ``max_tokens`` for every token-id prompt (ignore_eos, greedy) and collect vToken's stats."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import VTokenConfig, make_llm, vtoken_stats

    cfg = VTokenConfig(**vtoken)
    log(f"[{label}] starting vLLM ...")
    llm = make_llm(model_dir, cfg, dtype=dtype, block_size=32, max_model_len=max_model_len, enforce_eager=True,
                   seed=0, kv_cache_memory_bytes=kv_bytes, disable_log_stats=False, **kw)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])], SamplingParams(max_tokens=2), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = vtoken_stats(llm) if cfg.enabled else {}
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    finally:
        llm.llm_engine.engine_core.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    log(f"[{label}] {n_out} tokens in {seconds:.1f} s")
    engine = {k: v for k, v in stats.items() if k not in ("requests", "finished_requests")}
    engine["preemptions"] = metrics.get("vllm:num_preemptions")
    return ModeRun(label, seconds, n_out, stats.get("finished_requests", []), engine)


def real_prompts(model_dir: str, n: int, tokens: int) -> list[list[int]]:
    """``n`` prompts of ``tokens`` tokens of real text (see vtoken/texts.py), tokenised by the model's tokenizer."""
    from transformers import AutoTokenizer

    from vtoken.texts import real_text

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(real_text(min_chars=200_000))["input_ids"]
    stride = max(1, (len(ids) - tokens) // max(n, 1))
    return [ids[(i * stride) % max(1, len(ids) - tokens):][:tokens] for i in range(n)]
