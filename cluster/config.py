"""ServeConfig: everything `vtoken serve` reads from configs/serve.yaml, validated with clear errors."""

from __future__ import annotations

import ipaddress
import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


FAKE_MODEL = "tiny-llama"  # what a fake deployment that names no model renders with at the gateway


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Strict):
    kind: Literal["vllm", "fake"] = Field(
        "vllm",
        description="vllm: a vToken-enabled AsyncLLM. fake: an in-process "
        "stand-in with the same block accounting (tests, demos)",
    )
    dtype: str = Field("float32", description="model dtype; float32 is fastest on CPUs without bf16 support")
    block_size: int = Field(32, gt=0, description="KV block size in tokens (a multiple of 32 on CPU)")
    max_model_len: int = Field(1024, gt=0, description="longest prompt + completion, tokens")
    kv_cache_memory_bytes: int | None = Field(
        64 << 20, gt=0, description="KV pool size per replica; null lets vLLM size it from gpu_memory_utilization"
    )
    enforce_eager: bool = Field(
        True,
        description="no CUDA graphs (as the CPU recipes run). On CUDA false keeps vLLM's CUDA graphs: vToken's moves "
        "run outside every graph, piecewise graphs when a policy scores every step (configs/serve-gpu.yaml)",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="any other vLLM engine argument (the replicas' engines and the gateway's config take them alike: "
        "max_logprobs, generation_config, structured_outputs_config, ...)",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool parser for this model (vllm serve --tool-call-parser: hermes, llama3_json, "
        "pythonic, ...): tool calls in chat and Responses answers. tool_choice required or a named tool works "
        "without one (vLLM constrains the answer to the tools' JSON schema)",
    )
    enable_auto_tool_choice: bool = Field(
        False, description="tool_choice auto (vllm serve --enable-auto-tool-choice; needs tool_call_parser)"
    )
    reasoning_parser: str | None = Field(
        None,
        description="vLLM's reasoning parser for this model (vllm serve --reasoning-parser: deepseek_r1, qwen3, ...): "
        "the answer's reasoning apart from its content; the replicas' grammars wait for the end of reasoning by it",
    )
    fake_total_blocks: int = Field(64, gt=0, description="fake engine only: blocks in the pool")
    fake_token_delay_s: float = Field(0.01, ge=0, description="fake engine only: seconds per token")
    fake_start_s: float = Field(
        0.0, ge=0, description="fake engine only: seconds its start takes (a real engine takes ~30-60 s on CPU)"
    )
    fake_reclaim_fraction: float = Field(
        0.0, ge=0, le=1, description="fake engine only: share of held blocks it reports as reclaimed (metrics tests)"
    )

    @model_validator(mode="after")
    def _parsers(self):
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (as vllm serve)")
        if self.tool_call_parser is not None:
            from vllm.tool_parsers import ToolParserManager

            _known("tool_call_parser", self.tool_call_parser, ToolParserManager.list_registered())
        if self.reasoning_parser is not None:
            from vllm.reasoning import ReasoningParserManager

            _known("reasoning_parser", self.reasoning_parser, ReasoningParserManager.list_registered())
        return self

    @field_validator("extra")
    @classmethod
    def _no_internals(cls, v: dict[str, Any]) -> dict[str, Any]:
        """vToken picks vLLM's scheduler and worker classes and owns additional_config; a serving config that set
        them could switch on vToken's testing knobs (negative controls that corrupt answers) or bypass vToken."""
        taken = sorted({"scheduler_cls", "worker_cls", "additional_config"} & set(v))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by vToken, not in a serving config")
        return v


def _known(name: str, value: str, known) -> None:
    if value not in known:
        raise ValueError(f"{name}: {value!r} is not one of vLLM's: {', '.join(sorted(known))}")


class ReplicaConfig(_Strict):
    num_cpus: float = Field(1.0, ge=0, description="CPUs each replica actor reserves (fractions allowed)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (1 on a GPU cluster)")
    max_restarts: int = Field(-1, ge=-1, description="Ray restarts a dead replica this many times (-1: always)")
    report_interval_s: float = Field(1.0, gt=0, le=10, description="longest gap between two reports")
    change_fraction: float = Field(
        0.05, gt=0, le=1, description="report at once when free blocks move by this fraction of the pool"
    )
    scheduling: Literal["spread", "default"] = Field(
        "spread",
        description="where Ray places replicas: spread (across nodes, so one node lost takes as few replicas as "
        "can be; Ray Serve's default too) or default (Ray's default, which packs a node before the next)",
    )
    orphan_after_s: float = Field(
        30.0,
        gt=0,
        description="a replica whose controller is gone for good (its vtoken serve ended without stopping it: "
        "killed, its node lost) stops itself after this long, so nothing is left running on a cluster",
    )
    pin_cpus: bool = Field(
        False,
        description="CPU-only nodes: bind each replica's vLLM threads to cores of its "
        "own (VLLM_CPU_OMP_THREADS_BIND), num_cpus of them, so replicas run side by side like "
        "one device each instead of fighting over the same cores",
    )


class PlacementConfig(_Strict):
    strategy: str = Field(
        "prefix",
        description="prefix (the default: weighted plus the share of the prompt a replica's prefix cache holds, "
        "with a balance guard; as weighted where no replica holds a tenth of the prompt), weighted (free share less "
        "the work left, in tokens, and waiting requests, the best in `vtoken bench fleet`), free_blocks, "
        "round_robin, power_of_two or best_fit",
    )
    stale_after_s: float = Field(
        3.0,
        gt=0,
        description="a report older than this is stale: the replica keeps "
        "serving but its figures are only trusted with what was placed since",
    )
    dead_after_s: float = Field(6.0, gt=0, description="no report for this long: the replica is marked dead")
    promise_ttl_s: float = Field(
        600.0,
        gt=0,
        description="a placed request's blocks count against its replica until a report counts them or the "
        "request ends; a promise whose end never arrives (a gateway gone) is dropped after this long",
    )

    @field_validator("strategy")
    @classmethod
    def _known(cls, v: str) -> str:
        from cluster.placement.strategies import STRATEGIES

        if v not in STRATEGIES:
            raise ValueError(f"unknown placement strategy {v!r}; known: {', '.join(sorted(STRATEGIES))}")
        return v


class AutoscalingConfig(_Strict):
    enabled: bool = Field(False, description="let the controller change the replica count")
    min_replicas: int = Field(1, ge=1, description="never fewer replicas")
    max_replicas: int = Field(4, ge=1, description="never more replicas (on one machine also: the local CPUs)")
    # With vToken, compute runs short before blocks do, so scaling on blocks has to start early: at 15% / 0.25
    # the simulated day (vtoken bench fleet) kept 78.8% of requests within the SLA, at 50% / 1.0 97.4%.
    low_watermark: float = Field(
        0.5, gt=0, lt=1, description="scale out when effective free capacity stays under this fraction of all blocks"
    )
    scale_in_margin: float = Field(
        1.0,
        ge=0,
        description="scale in when effective free capacity exceeds one "
        "replica's blocks by this fraction of it (hysteresis between the two thresholds)",
    )
    sustain_s: float = Field(5.0, ge=0, description="a condition must hold this long before acting")
    cooldown_s: float = Field(30.0, ge=0, description="at least this long between two scaling decisions")
    request_resources: Literal["auto", "always", "never"] = Field(
        "auto",
        description="ask Ray's autoscaler (ray.autoscaler.sdk.request_resources) for the replicas' "
        "resources: auto = only when joined to a cluster with --address",
    )

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class GatewayConfig(_Strict):
    host: str = Field("127.0.0.1", description="bind address; anything but loopback needs TLS or allow_insecure_remote")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    http_port: int | Literal["any"] | None = Field(
        None,
        description="OpenAI-compatible HTTP port, /metrics included (0: no HTTP; any: any free port, reported "
        "like gRPC's; null: 8000, or any free port when port is 0). Same host, TLS and bearer token as gRPC",
    )
    tls_cert: str | None = Field(None, description="PEM certificate file")
    tls_key: str | None = Field(None, description="PEM private key file")
    allow_insecure_remote: bool = Field(False, description="explicit opt-out: bind a non-loopback address without TLS")
    auth_token_env: str | None = Field(
        None,
        description="environment variable holding a bearer token that "
        "every call must carry (authorization: Bearer <token>)",
    )
    max_request_bytes: int = Field(
        1 << 20, gt=0, description="larger requests get RESOURCE_EXHAUSTED (HTTP 413): what bounds a prompt's size"
    )
    max_inflight: int = Field(
        256,
        gt=0,
        description="requests admitted at once over both doors, from their rendering to their end (running + "
        "queued); beyond, RESOURCE_EXHAUSTED (HTTP 429)",
    )
    parse_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="threads that render chat templates and tokenize, off the gateway's event loop (vLLM's "
        "renderer_num_workers)",
    )
    responses_store: bool = Field(
        False,
        description="the Responses API's store (store, GET /v1/responses/{id}, previous_response_id), in the "
        "gateway's memory, unbounded and lost when the gateway restarts, as vLLM's (VLLM_ENABLE_RESPONSES_API_STORE); "
        "off: a stored response is not kept, as in vllm serve",
    )
    render_timeout_s: float = Field(
        10.0,
        gt=0,
        description="longest a request's chat template may render (beyond, HTTP 413 / RESOURCE_EXHAUSTED; the stuck "
        "thread is replaced); sets vLLM's VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT in the gateway",
    )
    max_n: int = Field(
        128, ge=1, le=16384, description="most sequences a request may ask for (n, best_of; OpenAI's cap); beyond, 400"
    )
    max_request_tokens: int = Field(
        1 << 20,
        gt=0,
        description="most tokens one request may make the fleet hold: n x prompts x (prompt + max tokens, the "
        "context's length when unset); beyond, 400 naming the field, before anything is built for it",
    )
    max_inflight_tokens: int = Field(
        1 << 22,
        gt=0,
        description="admission by work: the requests in flight over both doors hold at most this many tokens of "
        "work (a request's body size bounds its prompts until they are rendered); beyond, 429. A request alone is "
        "always admitted (cluster/serving/work.py)",
    )
    parse_timeout_s: float = Field(
        10.0,
        gt=0,
        description="longest a request may take from admission to its rendered prompt (chat template, tokenizing; "
        "for /tokenize and the render routes, the whole answer); beyond, HTTP 413 / RESOURCE_EXHAUSTED",
    )
    max_parse_pending: int = Field(
        32,
        ge=1,
        description="requests admitted but not yet rendered, over both doors, at once (they share the parse_workers "
        "threads); beyond, HTTP 503 / UNAVAILABLE",
    )
    grammar_workers: int = Field(
        1,
        ge=1,
        le=16,
        description="processes that check structured outputs (JSON schemas, regexes, grammars) off the gateway's "
        "event loop and heap (cluster/serving/grammar_pool.py; ~0.6 GB each)",
    )
    grammar_timeout_s: float = Field(
        5.0, gt=0, description="longest a structured output's check may take; beyond, 413 naming the field"
    )
    max_grammar_pending: int = Field(
        64, ge=0, description="requests waiting for a grammar worker at once; beyond, HTTP 503 / UNAVAILABLE"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="longest a client may take to send its request body; beyond, HTTP 408"
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest the gateway waits for a client to take a piece of its answer (a client that stopped "
        "reading); beyond, the answer is ended, its request aborted and its slot freed",
    )
    max_attempts: int = Field(3, ge=1, description="placements tried for a request that streamed nothing yet")
    place_timeout_s: float = Field(30.0, gt=0, description="longest wait for a live replica before UNAVAILABLE")
    placement_refresh_s: float = Field(
        0.1,
        ge=0,
        description="how often the gateway refreshes its copy of the replicas' views, from which it places requests "
        "without a call to the controller each (cluster/placement/placer.py; under placement.strategy prefix, with "
        "copies of the replicas' prefix indexes); 0: every request asks the controller",
    )
    token_channel: Literal["zmq", "ray"] = Field(
        "zmq",
        description="how replicas stream tokens to the gateway: zmq (one ZeroMQ socket, actors/token_channel.py) or "
        "ray (a Ray streamed object per chunk, several times the CPU per token)",
    )
    token_channel_host: str = Field(
        "127.0.0.1",
        description="address the zmq token channel binds (node: this Ray node's address, for replicas on other "
        "nodes; with a loopback address their tokens come through Ray streams)",
    )
    health_requires_auth: bool = Field(
        False,
        description="with auth_token_env set: whether grpc.health.v1.Health also needs the bearer token "
        "(false: health checks are open, as load-balancer probes cannot send one)",
    )

    @field_validator("http_port")
    @classmethod
    def _http_port(cls, v: int | str | None) -> int | str | None:
        if v not in (None, "any") and not 0 <= v <= 65535:
            raise ValueError(f"must be 0 (no HTTP), 'any' (any free port) or a port up to 65535, got {v}")
        return v

    @model_validator(mode="after")
    def _default_http_port(self):
        # gRPC on any free port (tests, benchmarks, several deployments on one machine): HTTP too, never a fixed
        # port nobody asked for.
        if self.http_port is None:
            object.__setattr__(self, "http_port", "any" if self.port == 0 else 8000)
        if self.port and self.http_port == self.port:
            raise ValueError(f"http_port and port are both {self.port}: gRPC and HTTP need a port each")
        return self

    @property
    def http_enabled(self) -> bool:
        return self.http_port != 0

    @property
    def http_bind_port(self) -> int:
        """The port to bind (0 for 'any'); only meaningful with HTTP enabled."""
        return 0 if self.http_port == "any" else int(self.http_port)

    @model_validator(mode="after")
    def _secure(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if not _is_loopback(self.host) and self.tls_cert is None and not self.allow_insecure_remote:
            raise ValueError(
                f"gateway host {self.host!r} is not loopback: set tls_cert and tls_key, or "
                "allow_insecure_remote: true to serve in clear text"
            )
        return self


class RayConfig(_Strict):
    address: str | None = Field(
        None,
        description="join this cluster (HOST:PORT of its GCS, or auto: the one `ray start` recorded here); null "
        "starts a local Ray of our own, whatever RAY_ADDRESS or an earlier `ray start` left on the machine",
    )
    namespace: str = Field(
        "vtoken", description="Ray namespace of the controller and replicas (with `name`, what identifies a service)"
    )
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the embedded local Ray (null: all)")
    connect_timeout_s: float = Field(
        60.0, gt=0, description="longest wait to start a local Ray or join a cluster; then one line and exit code 1"
    )


class ServeConfig(_Strict):
    """The whole serving deployment. Unknown keys are errors, so typos never pass silently."""

    name: str = Field("vtoken", pattern=r"^[a-z0-9][a-z0-9-]*$", description="deployment name (actor names)")
    model: str = Field(..., description="a prepared model name (vtoken models list) or a model folder")
    served_model_name: str | None = Field(
        None,
        description="the model's name to clients (OpenAI's model field, /v1/models) and in metrics' model_name; "
        "null: model",
    )
    replicas: int = Field(2, ge=1, description="replicas at start")
    vtoken: dict[str, Any] = Field(
        default_factory=lambda: {"mode": "vtoken"}, description="VTokenConfig fields (mode, policy, budget, ...)"
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @field_validator("vtoken")
    @classmethod
    def _vtoken(cls, v: dict[str, Any]) -> dict[str, Any]:
        from vtoken.config import VTokenConfig

        for key, value in _numbers(v, "vtoken"):
            if not math.isfinite(value):
                raise ValueError(f"{key}: must be a finite number, got {value}")
        try:
            return VTokenConfig(**v).model_dump()
        except ValidationError as e:  # VTokenConfig's own messages, one line, with the vtoken.* field named
            raise ValueError("; ".join(_vtoken_error(err) for err in e.errors())) from None
        except Exception as e:  # whatever VTokenConfig or a policy raises (OverflowError, TypeError, ...)
            raise ValueError(f"vtoken: {type(e).__name__}: {e}") from None

    @model_validator(mode="after")
    def _model_resolves(self):
        """A vLLM model must be a folder or a known prepared-model name, checked here rather than by a replica
        tens of seconds later. Whether a known model is prepared is checked where it is served (preflight)."""
        if self.engine.kind == "vllm" and not Path(self.model).is_dir():
            from vtoken.models import MODELS

            if self.model not in MODELS:
                raise ValueError(
                    f"model: {self.model!r} is neither a model folder nor a known model; known: "
                    f"{', '.join(sorted(MODELS))} (vtoken models list)"
                )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def model_folder(self) -> str:
        """The model's folder, whose config, tokenizer and chat template vLLM's serving layer loads at the gateway. A
        fake engine renders with the model ``model`` names (a folder or a prepared model), else with tiny-llama's
        (SmolLM2's tokenizer and template): the doors are vLLM's whatever the engine."""
        if Path(self.model).is_dir():
            return self.model
        from vtoken.models import MODELS, model_path

        if self.engine.kind == "fake" and self.model not in MODELS:
            return str(model_path(FAKE_MODEL))
        return str(model_path(self.model))


def engine_args(cfg: ServeConfig) -> dict[str, Any]:
    """The vLLM engine arguments of this deployment, as every replica's engine takes them (vToken's own are added
    there by ``engine_kwargs``) and as the gateway's render-only config is built from them
    (cluster/serving/frontend.py); the model is resolved where the engine runs."""
    e = cfg.engine
    args: dict[str, Any] = {
        "dtype": e.dtype,
        "block_size": e.block_size,
        "max_model_len": e.max_model_len,
        "enforce_eager": e.enforce_eager,
        "seed": 0,
        **e.extra,
    }
    if e.reasoning_parser:
        args["reasoning_parser"] = e.reasoning_parser
    if e.kv_cache_memory_bytes:
        args["kv_cache_memory_bytes"] = e.kv_cache_memory_bytes
    return args


def _vtoken_error(err: dict[str, Any]) -> str:
    """``vtoken.<field>: reason``: the field pydantic located, or the one a whole-config check names first
    (``policy_params.history: must be a whole number``)."""
    from vtoken.config import VTokenConfig

    reason = _reason(err["msg"])
    head, _, rest = reason.partition(": ")
    if not err["loc"] and head.split(".")[0] in VTokenConfig.model_fields and rest:
        return f"vtoken.{head}: {rest}"
    return ".".join(["vtoken", *map(str, err["loc"])]) + ": " + reason


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and every bad field."""


def load_config(path: str | Path, **overrides: Any) -> ServeConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "config") -> ServeConfig:
    """The config, or a ConfigError of one line that names every bad field and says what is wrong."""
    try:
        return ServeConfig(**raw)
    except ValidationError as e:
        parts = [_located(".".join(map(str, err["loc"])), _reason(err["msg"])) for err in e.errors()]
        raise ConfigError(f"{source}: invalid serve config: " + "; ".join(parts)) from None


def _located(loc: str, reason: str) -> str:
    """``field: reason``; checks that name their field themselves (top-level, vtoken.*) keep their own."""
    return reason if not loc or reason.startswith(loc + ".") or reason.startswith(loc + ":") else f"{loc}: {reason}"


def _reason(msg: str) -> str:
    return msg.removeprefix("Value error, ").replace("\n", " ")


def _numbers(v: Any, path: str):
    """(dotted path, value) of every float in a nested mapping (YAML's .inf and .nan are floats)."""
    if isinstance(v, float):
        yield path, v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _numbers(x, f"{path}.{k}")
    elif isinstance(v, list | tuple):
        for i, x in enumerate(v):
            yield from _numbers(x, f"{path}.{i}")


def preflight(cfg: ServeConfig, local: bool = True) -> None:
    """What can only be checked where and when the deployment starts, before anything is started: the auth
    token's variable is set; the model the gateway renders with (cfg.model_folder()) is prepared here. Raises
    ConfigError (one line)."""
    env = cfg.gateway.auth_token_env
    if env and not os.environ.get(env):
        raise ConfigError(
            f"gateway.auth_token_env: the environment variable {env} is not set; export {env}=<token> "
            "or set gateway.auth_token_env: null"
        )
    from vtoken.models import ModelPrepareError

    try:  # the gateway renders with the model's tokenizer and template, whatever the engine and wherever replicas run
        cfg.model_folder()
    except ModelPrepareError as e:
        raise ConfigError(f"model: {e}") from None
