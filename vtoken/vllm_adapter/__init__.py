"""vToken's vLLM 0.32.0 adapter: the only package that touches vLLM internals.

config.py        VTokenConfig, the user's switch (mode off | naive | vtoken, policy, budget, ...)
engine.py        engine_kwargs / make_llm / make_async_llm / vtoken_stats
scheduler.py     VTokenScheduler: TokenTables, policy decisions, compaction, block accounting
model_runner.py  worker side: moves before the forward, logical RoPE vs physical slots
scores.py        attention statistics for h2o / scissorhands, per physical slot on the device
worker.py        worker classes vLLM loads by name
"""

from vtoken.vllm_adapter.config import VTokenConfig, request_args
from vtoken.vllm_adapter.engine import engine_kwargs, make_async_llm, make_llm, vtoken_stats, vtoken_stats_async

__all__ = [
    "VTokenConfig",
    "request_args",
    "engine_kwargs",
    "make_async_llm",
    "make_llm",
    "vtoken_stats",
    "vtoken_stats_async",
]
