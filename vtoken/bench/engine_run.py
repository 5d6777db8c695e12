"""Shared benchmark plumbing: one vLLM engine per mode, token-id prompts, per-request results and stats.

``Engine`` is a context manager over ``vllm.LLM`` with vToken (``mode="off"`` is stock vLLM). ``batch``
serves prompts that may each carry their own policy options, and returns one ``Served`` per prompt with
vLLM's own per-request timestamps and preemption count, plus vToken's per-request record.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("off", "naive", "vtoken")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Served:
    prompt_tokens: int
    output_tokens: list[int]
    preemptions: int
    scheduled_ts: float  # engine-core monotonic clock
    first_token_ts: float
    last_token_ts: float
    record: dict[str, Any] = field(default_factory=dict)  # vToken's finished-request record (not for off)


@dataclass
class Batch:
    seconds: float
    served: list[Served]
    engine: dict[str, Any]  # vToken engine figures for this batch (empty for off)

    @property
    def output_tokens(self) -> int:
        return sum(len(s.output_tokens) for s in self.served)

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.served)

    @property
    def all_concurrent(self) -> bool:
        """Every request was in the running batch at one moment: the last to be scheduled started before
        the first to finish produced its last token."""
        return max(s.scheduled_ts for s in self.served) < min(s.last_token_ts for s in self.served)


class Engine:
    """``with Engine(model_dir, "vtoken", {"policy": "h2o", "budget": 0.25}) as e: e.batch(prompts, 64)``"""

    def __init__(
        self,
        model_dir: str,
        mode: str,
        vtoken: dict | None = None,
        dtype: str = "float32",
        kv_bytes: int = 1 << 30,
        max_model_len: int = 8192,
        block_size: int = 32,
        **kw,
    ) -> None:
        self.model_dir, self.mode, self.block_size = model_dir, mode, block_size
        # The benchmarks measure eviction at a budget: evict "always" unless they ask for pressure mode (the
        # engine's default, which evicts nothing while the pool holds everything).
        self.cfg = {"evict": "always", **(vtoken or {}), "mode": mode}
        if mode == "off":
            self.cfg = {"mode": "off"}
            if (vtoken or {}).get("prefill_chunk"):  # stock vLLM reads prompts in the same chunks
                kw.update(enable_chunked_prefill=True, long_prefill_token_threshold=vtoken["prefill_chunk"])
        self.kw = dict(
            dtype=dtype, kv_cache_memory_bytes=kv_bytes, max_model_len=max_model_len, block_size=block_size, **kw
        )
        self.llm = None

    def __enter__(self) -> Engine:
        from vtoken.vllm_adapter import VTokenConfig, make_llm

        log(f"[{self.mode}] starting vLLM on {self.model_dir.rstrip('/').rsplit('/', 1)[-1]} ...")
        self.llm = make_llm(
            self.model_dir, VTokenConfig(**self.cfg), enforce_eager=True, seed=0, disable_log_stats=False, **self.kw
        )
        return self

    def __exit__(self, *exc) -> None:
        from vtoken.vllm_adapter import shutdown_llm

        shutdown_llm(self.llm)
        self.llm = None

    @property
    def total_blocks(self) -> int:
        from vtoken.vllm_adapter import pool_blocks

        return pool_blocks(self.llm)

    def batch(
        self, prompts: list[list[int]], max_tokens: int, options: list[dict | None] | None = None, warmup: bool = False
    ) -> Batch:
        """Serve every prompt at once (greedy, ignore_eos) and wait for all of them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vtoken.vllm_adapter import request_args, vtoken_stats

        options = options or [None] * len(prompts)
        sps = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                extra_args=request_args(**o) if (o and self.mode != "off") else None,
            )
            for o in options
        ]
        before = vtoken_stats(self.llm, reset=True) if self.cfg["mode"] != "off" else {}
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = vtoken_stats(self.llm, reset=True) if self.cfg["mode"] != "off" else {}
        for key in COUNTERS:  # the engine's counters grow over its life: this batch's share
            if key in stats and key in before:
                stats[key] -= before[key]
        finished = {r["request_id"]: r for r in stats.get("finished_requests", [])}
        served = []
        for o in outs:
            m = o.metrics
            served.append(
                Served(
                    len(o.prompt_token_ids),
                    list(o.outputs[0].token_ids),
                    m.num_preemptions,
                    m.scheduled_ts,
                    m.first_token_ts,
                    m.last_token_ts,
                    finished.get(o.request_id, {}),
                )
            )
        engine = {k: v for k, v in stats.items() if k not in ("requests", "finished_requests")}
        return Batch(seconds, served, engine)


# vtoken_stats counters that grow over an engine's life (a batch reports its own share).
COUNTERS = (
    "compaction_seconds", "move_seconds", "score_seconds", "bytes_moved", "tokens_moved", "tokens_evicted",
    "tokens_parked", "tokens_restored", "tokens_recalled", "tokens_reinflated", "tokens_dropped_full", "recalls",
    "recall_bytes", "recall_seconds", "blocks_freed", "preemptions_seen", "preemptions_in_prefill",
)  # fmt: skip


def real_prompts(model_dir: str, n: int, tokens: int | list[int], offset: int = 0) -> list[list[int]]:
    """``n`` prompts of real text (see vtoken/texts.py), tokenised by the model's tokenizer; ``tokens`` is
    one length for all or one per prompt. Prompts start at spread-out places in the text."""
    from transformers import AutoTokenizer

    from vtoken.texts import real_text

    lengths = [tokens] * n if isinstance(tokens, int) else list(tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(real_text(min_chars=200_000))["input_ids"]
    longest = max(lengths)
    span = max(1, len(ids) - longest)
    stride = max(1, span // max(n, 1))
    return [ids[(offset + i * stride) % span :][: lengths[i]] for i in range(n)]
