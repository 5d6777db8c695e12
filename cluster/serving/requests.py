"""A request as both front doors hand it to the dispatcher, and a request's own eviction options, checked once.

vLLM's serving layer does the rest, as in ``vllm serve``: the HTTP door runs vLLM's OpenAI routes and serving classes
(cluster/doors/http_server.py), the gRPC door renders with the same renderer (cluster/doors/grpc_requests.py), and both
hand the rendered prompt and vLLM's ``SamplingParams`` to the remote engine client (cluster/serving/remote_engine.py),
which builds a ``ValidRequest`` for placement. What is vToken's own is here: the ``vtoken`` extension (HTTP
``extra_body={"vtoken": {...}}``, gRPC ``VTokenOptions``), refused with a ``BadRequest`` naming ``vtoken.<key>``.
Nothing here touches Ray or the engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from vtoken.config import REQUEST_KEYS, VTokenConfig, request_args

EXTENSION = "vtoken"  # the request's own eviction options: HTTP extra_body={"vtoken": {...}}, gRPC VTokenOptions


RENDER_TIMEOUT_ENV = "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT"  # vLLM's bound on one template rendering (renderers/hf.py)


def render_too_long(e: BaseException) -> Exception | None:
    """vLLM's renderer gave up on a chat template (``HfRenderer._render_with_timeout``, a bare ``TimeoutError``
    that vLLM's server answers with a 500) as the request's fault: a 413 naming the gateway's key; else None."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    if not isinstance(e, TimeoutError) or not str(e).startswith("Chat template rendering timed out"):
        return None
    bound = os.environ.get(RENDER_TIMEOUT_ENV, "?")
    message = f"rendering the chat template took longer than gateway.render_timeout_s ({bound} s); refused"
    return GracefulHTTPError(message, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


class BadRequest(ValueError):
    """The request cannot be served as sent; ``param`` names the field at fault when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------------- eviction
class Eviction(NamedTuple):
    """A request's own eviction options as checked: ``extra_args`` for ``SamplingParams`` (None when it chose
    none) and ``config``, the served VTokenConfig with them applied (its budget bounds the request's blocks)."""

    extra_args: dict[str, Any] | None
    config: VTokenConfig


def vtoken_options(options: Any, served: dict[str, Any]) -> Eviction:
    """The one check of a request's eviction options, for both doors (gRPC ``VTokenOptions``, HTTP's
    ``"vtoken": {...}``): a mapping of ``request_args`` keys (policy, budget, interval, sink, recent, seed,
    policy_params, prefill_evict, prefill_window, evict, pressure_floor) that ``request_args`` accepts and that the
    served config accepts too (``VTokenConfig.for_request``: e.g. h2o on an engine that collects no attention scores
    is refused). What passes is exactly what the engine will accept; refusals are BadRequest naming vtoken.<key>."""
    cfg = VTokenConfig(**served)
    if options is None or options == {}:
        return Eviction(None, cfg)
    if not isinstance(options, dict):
        raise BadRequest(f"vtoken: expected an object of eviction options, got {type(options).__name__}", "vtoken")
    if not cfg.enabled:
        raise BadRequest(
            "vtoken: this deployment serves with eviction off (vtoken.mode: off); per-request eviction options "
            "need vtoken.mode: vtoken or naive",
            "vtoken",
        )
    for key, value in options.items():
        if key not in REQUEST_KEYS:
            raise BadRequest(
                f"vtoken.{key}: not a per-request option; a request may set {', '.join(sorted(REQUEST_KEYS))}",
                f"vtoken.{key}",
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"vtoken.{key}: must be a finite number, got {value}", f"vtoken.{key}")
    try:
        extra = request_args(**options)
        effective = cfg.for_request(options)
    except ValidationError as e:
        named = [_option_error(".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")) for err in
                 e.errors()]  # fmt: skip
        raise BadRequest("; ".join(f"{w}: {m}" for w, m in named), named[0][0]) from None
    except (ValueError, TypeError, OverflowError) as e:  # the policy's own checks, its parameters; option pairs
        where, msg = _option_error("", str(e).splitlines()[0])
        raise BadRequest(f"{where}: {msg}", where) from None
    return Eviction(extra, effective)


def _option_error(loc: str, msg: str) -> tuple[str, str]:
    """(the ``vtoken.*`` field at fault, the reason) of an option error: pydantic's ``loc`` where it has one, else
    the option a message starts with (``policy_params.history: must be a whole number``, ``pressure_floor: ...``)."""
    if not loc:
        head, _, rest = msg.partition(": ")
        if head.split(".")[0] in REQUEST_KEYS and rest:
            loc, msg = head, rest
        elif "policy" in msg:
            loc = "policy"
    return ("vtoken." + loc if loc else "vtoken"), msg


class ValidRequest(BaseModel):
    """A request either door has validated: what the dispatcher places and the engine runs."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    request_id: str  # the gateway's, unique per stream: the engine, the replica and the controller know it by this
    client_id: str  # the client's own (gRPC request_id, HTTP's request id; clients may reuse it), for logs
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # non-default vllm.SamplingParams fields (actors/wire.py sampling_kwargs)
    max_tokens: int  # per sequence, as placement counts it (remote_engine._valid sets it, once)
    n: int = 1  # sequences
    deadline_s: float | None = None
    eviction: Eviction | None = None  # the request's own eviction options, checked (vtoken_options)
    # The prompt's block hashes (vtoken/prefix_hash.py): placement matches them against
    # the replicas' prefix caches. Empty: placement weighs no prefix.
    prefix_hashes: tuple[int, ...] = ()
    # AsyncLLM.generate's own arguments that the serving layer set (priority, reasoning_ended, ...)
    engine_kwargs: dict[str, Any] = {}

    def spec_sampling(self) -> dict[str, Any]:
        """What crosses to the replica: the sampling, with the request's eviction options in ``extra_args``."""
        if not (self.eviction and self.eviction.extra_args):
            return dict(self.sampling)
        return {**self.sampling, "extra_args": {**(self.sampling.get("extra_args") or {}), **self.eviction.extra_args}}


# ---------------------------------------------------------------------------------------------- context
class RequestContext(NamedTuple):
    """What a door knows of a request that vLLM's serving layer does not carry to ``generate``."""

    door: str = "http"
    eviction: Eviction | None = None  # the request's own eviction options (None: the deployment's)
    deadline_s: float | None = None
    client_id: str = ""  # the client's own id for the request (logs, errors); engines know the gateway's
    # Filled in by ``generate`` for the door: "replica", the last replica that streamed for the request (gRPC's
    # GenerateResponse.replica). A dict, so tasks the serving layer starts write where the door reads.
    seen: dict | None = None
    live: Live | None = None  # the HTTP door's: its generate calls still running (a background Responses request)
    parse: Any = (
        None  # cluster.serving.dispatch.ParseStage: ended when the serving layer hands over the rendered prompt
    )
    tally: Any = (
        None  # cluster.serving.work.WorkTally: the request's work, summed over its prompts as they are rendered
    )
    grammar_field: str = "structured_outputs"  # the field a client set its structured output with


class Live:
    """The ``generate`` calls of one HTTP request still running, so its admission lasts as long as they do: a
    background Responses request (``background: true``) runs on after its answer went out. ``door_done``: the door's
    own admission has ended; a ``generate`` that starts after it is admitted on its own. ``stalled``: the client took
    nothing for ``gateway.write_timeout_s``; its ``generate`` calls end before their next output, so what piled up
    meanwhile is never rendered into events nobody reads."""

    def __init__(self) -> None:
        self.n, self.door_done, self.idle = 0, False, asyncio.Event()
        self.stalled = False
        self.idle.set()

    def enter(self) -> None:
        self.n += 1
        self.idle.clear()

    def exit(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.idle.set()


# Set by a door for the request it serves (the HTTP door's middleware, the gRPC handler); tasks the serving layer
# starts for the request inherit it.
CONTEXT: contextvars.ContextVar[RequestContext] = contextvars.ContextVar("vtoken_request", default=RequestContext())  # noqa: B039 (seen: None)
