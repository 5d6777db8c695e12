"""vLLM's serving layer in the gateway, without weights: the arguments ``vllm serve`` would take for this deployment,
and a CPU ``VllmConfig`` built as vLLM's GPU-less render server builds it
(vllm/entrypoints/launchers/render/entry.py: ``AsyncEngineArgs(...).create_model_config()``, the model's config,
tokenizer, chat template and generation defaults; no engine, no KV cache; about 2 s and 0.7 GB here).

The same engine arguments build every replica's engine (cluster/config.py ``engine_args``, which
cluster/control/lifecycle.py passes to each replica), so what the gateway validates and renders is what the replicas
run: the context length, ``max_logprobs``, the structured-output backend and the reasoning parser (the EngineCore's
grammar waits for the end of reasoning by it) come from one place.
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from typing import Any, NamedTuple

from cluster.config import ServeConfig, engine_args
from cluster.serving.requests import RENDER_TIMEOUT_ENV, render_too_long

log = logging.getLogger("vtoken.frontend")
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vllm/envs.py: read by build_app (vllm/entrypoints/launchers/api_server)


class Frontend(NamedTuple):
    """What vLLM's serving classes are built from: ``args`` as vLLM's OpenAI server parses its flags, and the
    ``vllm_config`` its engine client carries."""

    args: Namespace
    vllm_config: Any


def frontend(cfg: ServeConfig) -> Frontend:
    """Parse vLLM's OpenAI-server flags for this deployment and build its CPU config (call it in a thread: vLLM's
    imports and the tokenizer take a few seconds)."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    folder = cfg.model_folder()
    e = cfg.engine
    argv = ["--model", folder, "--served-model-name", cfg.model_name, "--disable-log-stats"]
    if e.tool_call_parser:
        argv += ["--tool-call-parser", e.tool_call_parser]
    if e.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    from vtoken.vllm_adapter.engine import config_objects

    for key, value in config_objects(engine_args(cfg)).items():
        if key == "kv_cache_memory_bytes":
            continue  # the replicas' pools; the gateway holds none
        if not hasattr(args, key):
            raise ValueError(f"engine.extra.{key}: not an argument of vLLM's engine")
        setattr(args, key, value)
    args.renderer_num_workers = cfg.gateway.parse_workers
    # vLLM reads its bound on a template's rendering from the environment, at every rendering (vllm/envs.py)
    os.environ[RENDER_TIMEOUT_ENV] = str(cfg.gateway.render_timeout_s)
    # vLLM's Responses serving reads its store switch from the environment when it is built (init_app_state)
    os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1" if cfg.gateway.responses_store else "0"
    engine = AsyncEngineArgs.from_cli_args(args)
    model_config = engine.create_model_config()
    model_config.quantization = None  # a render-only config: no quantized kernels (as vLLM's render server)
    structured = engine.create_structured_outputs_config()
    args.structured_outputs_config = structured
    engine._set_default_reasoning_config_args()  # as create_engine_config does for the replicas' engines
    config = VllmConfig(
        model_config=model_config,
        logging_config=engine.create_logging_config(),
        structured_outputs_config=structured,
        reasoning_config=engine.reasoning_config,
    )
    return Frontend(args, config)


class Served(NamedTuple):
    """vLLM's OpenAI app over the replicas, shared by both doors: ``app`` (routes and serving classes, its
    ``state`` holding them) and the engine client they call."""

    app: Any
    engine: Any  # cluster.serving.remote_engine.RemoteEngineClient


async def serving_app(cfg: ServeConfig, dispatcher: Any) -> Served:
    """vLLM's OpenAI app (``build_app`` and ``init_app_state``, as ``vllm serve`` builds them) over a
    ``RemoteEngineClient`` that places every request through ``dispatcher``."""
    import asyncio

    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    from cluster.serving.remote_engine import SUPPORTED_TASKS, RemoteEngineClient

    fe = await asyncio.to_thread(frontend, cfg)
    engine = await asyncio.to_thread(RemoteEngineClient, cfg, fe.vllm_config, dispatcher)
    engine.grammars.start()
    if os.environ.pop(DEV_MODE_ENV, "0") not in ("", "0"):
        # vLLM mounts routes that steer its one engine (reset caches, sleep, collective RPCs) with it: never here
        log.warning("%s is set in the gateway's environment; vLLM's development routes are not served", DEV_MODE_ENV)
    app = build_app(fe.args, SUPPORTED_TASKS, fe.vllm_config.model_config)
    app.exception_handler(TimeoutError)(_timeout_handler)
    if app.middleware_stack is not None:  # built by vLLM's SageMaker bootstrap: rebuilt with the handler, as it does
        app.middleware_stack = app.build_middleware_stack()
    await init_app_state(engine, app.state, fe.args, SUPPORTED_TASKS)
    from cluster.serving.template_kwargs import TemplateKwargs

    online = getattr(app.state, "online_renderer", None)
    kwargs = TemplateKwargs.of(engine.renderer, getattr(online, "chat_template", None))
    engine.template_variables = kwargs.variables
    return Served(app, engine)


async def _timeout_handler(request: Any, exc: Exception) -> Any:
    """A chat template that rendered past ``gateway.render_timeout_s`` is the request's fault, a 413 (beside vLLM's
    handlers, vllm/entrypoints/serve/exception_handling/register.py, whose safety net answers it with a 500)."""
    from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler
    from vllm.entrypoints.serve.exception_handling.handlers.vllm_error import vllm_error_handler

    mapped = render_too_long(exc)
    if mapped is None:
        return await exception_handler(request, exc)
    return await vllm_error_handler(request, mapped)
