"""Runs a vLLM engine (stock or with vToken) on token-id prompts and returns what tests compare."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    stats: dict = field(default_factory=dict)
    trace: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    scorer: dict = field(default_factory=dict)  # the worker's score counts (vtoken_score_counts)


def prompts(n: int = 3, lengths=(70, 130, 45), seed: int = 0, vocab: int = 49000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, lengths[i % len(lengths)]).tolist() for i in range(n)]


def run(
    model: str,
    vtoken: dict | None,
    token_prompts: list[list[int]],
    max_tokens: int = 48,
    dtype: str = "float32",
    trace_dir: Path | None = None,
    kv_bytes: int = 64 << 20,
    max_model_len: int = 1024,
    rounds: int = 1,
    options: list[dict | None] | None = None,
    knobs: dict | None = None,
    **kwargs,
) -> Run:
    """``options[i]``: request i's own vToken policy options (SamplingParams.extra_args), or None.
    ``knobs``: testing knobs (vtoken/vllm_adapter/testing.py), e.g. a negative control."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import VTokenConfig, open_llm, request_args, testing, vtoken_stats

    cfg = dict(vtoken or {"mode": "off"})
    trace_path = None
    if cfg.get("mode", "vtoken") != "off" and trace_dir is not None:
        trace_path = Path(trace_dir) / f"trace-{len(list(Path(trace_dir).glob('trace-*')))}.jsonl"
        cfg["trace_path"] = str(trace_path)
    engine_args = dict(
        dtype=dtype,
        block_size=32,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        enforce_eager=True,
        **kwargs,
    )
    cfg = {"evict": "always", **cfg}  # the tests of eviction at a budget; pressure mode's ask for it
    if knobs:
        opened = testing.open_llm(model, VTokenConfig(**cfg), testing.Knobs(**knobs), **engine_args)
    else:
        opened = open_llm(model, VTokenConfig(**cfg), **engine_args)
    with opened as llm:
        options = options or [None] * len(token_prompts)
        sps = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                logprobs=0,
                ignore_eos=True,
                detokenize=False,
                extra_args=request_args(**o) if o else None,
            )
            for o in options
        ]
        outs = [
            o
            for _ in range(rounds)
            for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], sps, use_tqdm=False)
        ]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        lps = [np.array([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]
        stats = vtoken_stats(llm) if cfg.get("mode", "vtoken") != "off" else {}
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        scorer = llm.collective_rpc("vtoken_score_counts")[0] if cfg.get("mode", "vtoken") != "off" else {}
        trace = []
        if trace_path is not None and trace_path.exists():
            by_id = {t["request_id"]: t for t in map(json.loads, trace_path.read_text().splitlines())}
            trace = [by_id[o.request_id] for o in outs]  # lines carry the caller's (LLM's) request id
        return Run(tokens, lps, stats, trace, metrics, scorer)
