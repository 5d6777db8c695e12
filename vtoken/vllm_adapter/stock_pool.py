"""The KV pool of a stock vLLM engine (vToken off), from vLLM's own scheduler statistics.

vToken's scheduler answers ``vtoken_pool_report`` itself; with vToken off the engine is stock vLLM, the baseline
users compare against, and nothing of it is replaced. Its pool is read the way vLLM's own Prometheus logger reads
it: a stat logger (vllm/v1/metrics/loggers.py StatLoggerBase, passed to ``AsyncLLM(stat_loggers=...)``) keeps the
last ``SchedulerStats`` the EngineCore sent (``kv_cache_usage`` = 1 - free / usable blocks, vllm/v1/core/block_pool.py
BlockPool.get_usage, and the running and waiting counts, computed after the step's finished requests were freed),
and the pool's size comes from ``vllm_config.cache_config.num_gpu_blocks``. Statistics arrive with each step's
outputs, so figures are at most one step old; an idle engine's last step already counted every block it freed.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


class StockPool:
    """What the last step's statistics said; ``free_blocks(total)`` in blocks."""

    def __init__(self) -> None:
        self.usage = 0.0  # no step yet: every block is free
        self.running = 0
        self.waiting = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache, and hits, since the engine started
        self.prefix_hits = 0

    def logger_factory(self):
        """For ``AsyncLLM.from_engine_args(..., stat_loggers=[pool.logger_factory()])``."""
        return functools.partial(_StockPoolLogger, pool=self)

    def free_blocks(self, total: int) -> int:
        return max(min(round((1.0 - self.usage) * total), total), 0)


class _StockPoolLogger(StatLoggerBase):
    """A per-engine stat logger that only keeps the numbers (vLLM calls ``record`` on its output loop)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, pool: StockPool | None = None) -> None:
        self.pool = pool if pool is not None else StockPool()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        p = self.pool
        p.usage = float(scheduler_stats.kv_cache_usage)
        p.running, p.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
        cache = scheduler_stats.prefix_cache_stats
        if cache is not None:
            p.prefix_queries += int(cache.queries)
            p.prefix_hits += int(cache.hits)

    def log_engine_initialized(self) -> None:
        pass
