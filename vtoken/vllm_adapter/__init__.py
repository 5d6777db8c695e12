"""vToken's vLLM 0.32.0 adapter: the only package that touches vLLM internals. The user's switch, VTokenConfig,
lives in vtoken/config.py and the pool report in vtoken/pool_report.py (no torch, no vLLM); both are re-exported.

engine.py        engine_kwargs / make_llm / open_llm / make_async_llm / vtoken_stats / pool_report
scheduler.py     VTokenScheduler: vLLM glue around the compactor (vtoken/core/compactor.py)
model_runner.py  worker side: moves before the forward, logical RoPE vs physical slots
scores.py        attention statistics for h2o / scissorhands, per physical slot on the device
move_waits.py    CUDA: each attention layer waits only for its own layers' moves (graph safe)
cpu_layout.py    the KV layout vLLM's CPU kernel writes on this machine, learned from its own cache write
worker.py        worker classes vLLM loads by name
"""

from vtoken.config import VTokenConfig, request_args
from vtoken.pool_report import PoolReport
from vtoken.vllm_adapter.engine import (
    engine_kwargs,
    make_async_llm,
    make_llm,
    open_llm,
    pool_blocks,
    pool_report,
    pool_report_async,
    shutdown_llm,
    vtoken_stats,
    vtoken_stats_async,
)

__all__ = [
    "PoolReport",
    "VTokenConfig",
    "request_args",
    "engine_kwargs",
    "make_async_llm",
    "make_llm",
    "open_llm",
    "pool_blocks",
    "pool_report",
    "pool_report_async",
    "shutdown_llm",
    "vtoken_stats",
    "vtoken_stats_async",
]
