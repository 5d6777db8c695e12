"""vLLM's ``EngineClient`` over the replicas: what vLLM's serving classes (chat, completions, Responses,
tokenize) call in ``vllm serve``'s process, served by placing each request on a replica.

vLLM's serving layer validates the request, renders it (chat template, tool and reasoning parsers) and builds its
``SamplingParams`` in the gateway; ``generate`` then receives the rendered prompt (token ids) and the full sampling,
so placement knows all it needs: the prompt's ids and their prefix hashes, ``n`` and ``max_tokens``, and the
request's own eviction options (the ``vtoken`` extension, checked at the door and carried here in ``CONTEXT``).
``n > 1`` fans out in the replica's ``AsyncLLM`` (as in ``vllm serve``), so the request is placed once with
``n`` times its blocks; grammars run in the replica's EngineCore, detokenization and stop strings in its output
processor. The replica streams DELTA outputs (actors/wire.py) whatever the serving layer asked, so time to first
token and retries before the first output work alike for whole answers; this client merges them when the
serving layer asked FINAL_ONLY.

Failures keep vLLM's shapes and the door's statuses (the dispatcher's ``Refused`` as vLLM's own exceptions): a bad
request is a ``VLLMValidationError`` (400), no replica or one lost mid-answer a ``GracefulHTTPError`` 503, a
deadline 504, over ``max_inflight`` 429, a fault of ours a ``GenerationError`` (500). Never ``EngineDeadError``:
``errored`` stays False, because vLLM's server exits when its one engine is dead, and one replica's death is one
request's error here (placed again elsewhere before its first output).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import GenerationError, GracefulHTTPError, VLLMError, VLLMNotFoundError, VLLMValidationError
from vllm.renderers import renderer_from_config
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.input_processor import InputProcessor

from actors.wire import sampling_kwargs, to_output
from cluster.config import ServeConfig
from cluster.serving.dispatch import Dispatcher, Refused, internal_message
from cluster.serving.grammar_pool import GrammarBusy, GrammarPool, GrammarTooLong
from cluster.serving.requests import CONTEXT, EXTENSION, BadRequest, RequestContext, ValidRequest, vtoken_options
from vtoken.prefix_hash import prefix_hashes

log = logging.getLogger("vtoken.engine_client")
SUPPORTED_TASKS = ("generate",)  # what the replicas serve: vLLM's routes for the rest are not registered
STATUS = {  # Refused.code -> what vLLM's serving layer turns into the same status
    "resource_exhausted": HTTPStatus.TOO_MANY_REQUESTS,
    "too_large": HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    "unavailable": HTTPStatus.SERVICE_UNAVAILABLE,
    "deadline_exceeded": HTTPStatus.GATEWAY_TIMEOUT,
    "unauthenticated": HTTPStatus.UNAUTHORIZED,
}


def vllm_error(e: Refused) -> Exception:
    """The dispatcher's refusal as the vLLM exception that gives its status and OpenAI's error shape."""
    if e.code == "invalid_argument":
        return VLLMValidationError(e.message, parameter=e.param)
    if e.code == "not_found":
        return VLLMNotFoundError(e.message)
    if e.code == "internal":
        return GenerationError(e.message)
    return GracefulHTTPError(e.message, STATUS[e.code])


class RemoteEngineClient(EngineClient):
    """Invariants: ``errored`` is never True (a replica's death is its request's error, not the server's); every
    ``generate`` goes through the dispatcher (admission at the door, placement, retries, aborts, metrics); the
    replica's engine knows a request by the serving layer's id made unique (clients may reuse theirs)."""

    def __init__(self, cfg: ServeConfig, vllm_config: Any, dispatcher: Dispatcher):
        self.cfg, self.dispatcher = cfg, dispatcher
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.served = vtoken_options(None, cfg.vtoken)  # the deployment's own eviction options
        g = cfg.gateway
        self.grammars = GrammarPool(vllm_config, g.grammar_workers, g.grammar_timeout_s, g.max_grammar_pending)
        self._running: dict[str, asyncio.Task] = {}  # serving-layer request id -> the task iterating it
        self.template_variables: frozenset[str] = frozenset()  # what chat_template_kwargs may set (serving_app)

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        ctx = CONTEXT.get()
        # The engine's, the controller's and the replica's id for it: the serving layer's (a response's id, so logs and
        # the engine's finished records name what the client saw) made unique, as AsyncLLM makes it (clients may
        # choose theirs: X-Request-Id, request_id).
        rid = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if ctx.parse is not None:
            ctx.parse.end()  # rendered: the door's parse bound no longer applies
        live = ctx.live
        try:
            with contextlib.ExitStack() as held:
                if live is not None:
                    live.enter()
                    held.callback(live.exit)
                    if live.door_done:  # started after its door's answer (a background request): admitted on its own
                        held.enter_context(self.dispatcher.admit(ctx.door))
                async for out in self._generate(prompt, sampling_params, request_id, ctx, rid, kwargs):
                    yield out
        except Refused as e:  # the cause stays for the gRPC door, which maps codes, not HTTP statuses
            raise vllm_error(e) from e
        except (VLLMError, ValueError, TypeError, OverflowError):
            raise  # vLLM's own (its statuses), the request's fault (vLLM's validation raises ValueError), or the end
        except Exception as e:  # a fault of ours: 500 with an id the log has, never its text (paths, internals)
            log.exception("request %s (client id %r) failed", rid, ctx.client_id)
            raise GenerationError(internal_message(ctx.client_id, rid)) from e

    async def _generate(self, prompt, sampling_params, request_id: str, ctx: RequestContext, rid: str, kwargs: dict):
        valid = await self._valid(prompt, sampling_params, request_id, ctx, rid, kwargs)
        kind, merged = sampling_params.output_kind, None
        task = asyncio.current_task()
        if task is not None:
            self._running[request_id] = task
        text, ids = prompt.get("prompt"), valid.prompt_token_ids
        try:
            async with contextlib.aclosing(self.dispatcher.stream(valid, ctx.door)) as deltas:
                async for d in deltas:
                    if ctx.live is not None and ctx.live.stalled:
                        # As a disconnect ends it, but now: vLLM's stream would otherwise turn the whole backlog of
                        # a client that stopped reading into events in one go (0.3-0.6 s of the event loop at n=24),
                        # without a suspension where the disconnect's cancellation could land
                        raise asyncio.CancelledError("the client took nothing for gateway.write_timeout_s")
                    if ctx.seen is not None:
                        ctx.seen["replica"] = d.replica
                    out = to_output(d.chunk, request_id, text, ids)
                    if kind == RequestOutputKind.DELTA:
                        yield out
                        continue
                    if merged is None:
                        merged = out
                    else:
                        merged.add(out, aggregate=True)
                    if kind == RequestOutputKind.CUMULATIVE or merged.finished:
                        merged.outputs.sort(key=lambda o: o.index)  # AsyncLLM's order (add() appends by arrival)
                        yield merged
        finally:
            if self._running.get(request_id) is task:
                del self._running[request_id]

    async def _valid(
        self, prompt: Any, params: Any, request_id: str, ctx: RequestContext, rid: str, kwargs: dict
    ) -> ValidRequest:
        """The rendered request as the dispatcher places it, checked by vLLM's own input processor first (what
        ``AsyncLLM.generate`` checks before a request enters the engine: sampling against the model, the
        structured-output grammar, the prompt's length), so a bad request is refused before any placement. The
        grammar is checked in a worker process (cluster/serving/grammar_pool.py), the rest here without it."""
        if not isinstance(prompt, dict) or prompt.get("type") != "token":
            kind = prompt.get("type") if isinstance(prompt, dict) else type(prompt).__name__
            raise VLLMValidationError(f"vtoken serve takes text and token-id prompts, not {kind} prompts")
        grammar = params.structured_outputs
        params.structured_outputs = None  # checked apart, in a worker (below); process_inputs checks a copy
        try:
            self.input_processor.process_inputs(request_id, prompt, params, supported_tasks=SUPPORTED_TASKS)
        finally:
            params.structured_outputs = grammar
        if ctx.tally is not None:
            try:
                ctx.tally.add(params.n, len(prompt["prompt_token_ids"]), params.max_tokens or 0)
            except BadRequest as e:
                raise VLLMValidationError(e.args[0], parameter=e.param) from None
        if grammar is not None:
            try:
                await self.grammars.check(request_id, prompt, params)
            except GrammarTooLong as e:  # named in the message: vLLM's 413 carries no ``param``
                raise GracefulHTTPError(f"{ctx.grammar_field}: {e}", HTTPStatus.REQUEST_ENTITY_TOO_LARGE) from e
            except GrammarBusy as e:
                raise GracefulHTTPError(str(e), HTTPStatus.SERVICE_UNAVAILABLE) from e
            except VLLMValidationError as e:
                raise VLLMValidationError(e.args[0], parameter=e.parameter or ctx.grammar_field) from None
        sampling = sampling_kwargs(params)
        if EXTENSION in (sampling.get("extra_args") or {}):
            raise VLLMValidationError(
                "vllm_xargs.vtoken: set eviction options in the request's own `vtoken` field", parameter="vllm_xargs"
            )
        ids = list(prompt["prompt_token_ids"])
        # AsyncLLM.generate's own arguments beside the prompt (an explicit reasoning_ended=False is kept: the
        # replica's engine would otherwise judge the prompt itself), and the prompt's cache_salt (the replica's
        # prefix cache keeps salted prefixes apart, as vLLM's does; placement then follows no prefix)
        engine = {k: v for k, v in kwargs.items() if k in ("priority", "reasoning_ended", "reasoning_parser_kwargs")
                  and v is not None and not (k == "priority" and v == 0)}  # fmt: skip
        salt = prompt.get("cache_salt")
        if salt:
            engine["cache_salt"] = salt
        return ValidRequest(
            request_id=rid,
            client_id=ctx.client_id or request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            # vLLM's serving layer always sets max_tokens; one it left unset (None: up to the context) is counted
            # as SamplingParams' default, 16, as it always was here
            max_tokens=16 if params.max_tokens is None else params.max_tokens,
            n=params.n,
            deadline_s=ctx.deadline_s,
            eviction=ctx.eviction or self.served,
            prefix_hashes=() if salt else prefix_hashes(ids, self.cfg.engine.block_size),
            engine_kwargs=engine,
        )

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """The door admitted the request (Dispatcher.admit, before vLLM renders it); a request beyond
        ``max_inflight`` that got this far (a serving class called without a door) is refused here, 429."""
        if self.dispatcher.inflight > self.cfg.gateway.max_inflight:
            raise GracefulHTTPError(
                f"server busy: {self.dispatcher.inflight} requests in flight (limit {self.cfg.gateway.max_inflight})",
                HTTPStatus.TOO_MANY_REQUESTS,
            )

    async def abort(self, request_id: Any) -> None:
        """vLLM's serving layer aborts a request it gave up on (a cancelled background Responses request): the task
        iterating it is cancelled, which aborts it in its replica."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            task = self._running.get(rid)
            if task is not None:
                task.cancel()

    # ------------------------------------------------------------------ health
    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return GracefulHTTPError("no replica can serve", HTTPStatus.SERVICE_UNAVAILABLE)

    async def check_health(self) -> None:
        return None

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return SUPPORTED_TASKS

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    # ------------------------------------------------------------------ what a cluster of replicas does not serve
    def encode(self, *args: Any, **kwargs: Any):
        raise VLLMValidationError("vtoken serve serves generation, not pooling")

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("profiling a replica: Ray's tools")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profiling a replica: Ray's tools")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return False

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("replicas do not sleep; scale in instead (vtoken scale)")

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError("replicas do not sleep; scale in instead (vtoken scale)")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        raise NotImplementedError("LoRA adapters are not served by vtoken serve")

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("drain a replica instead (vtoken scale)")

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        self.grammars.close()
        self.renderer.shutdown()
