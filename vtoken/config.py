"""VTokenConfig: the one switch users set. Travels to vLLM's EngineCore and workers inside
``VllmConfig.additional_config["vtoken"]``, so every process builds the same policy."""

from __future__ import annotations

import collections
import json
import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vtoken.core.policies import EvictionPolicy, PolicyParamError, make_policy

logger = logging.getLogger(__name__)
CONFIG_KEY = "vtoken"
# What one request may choose for itself, in ``SamplingParams(extra_args={"vtoken": {...}})``.
REQUEST_KEYS = frozenset(
    {
        "policy", "budget", "interval", "sink", "recent", "seed", "policy_params", "prefill_evict", "prefill_window",
        "evict", "pressure_floor", "recall_every",
    }
)  # fmt: skip


# The shipped budget: VTokenConfig's default and every benchmark's (tests/test_docs.py holds the configs to it).
# Chosen with the floor (none) and recall (off) from the frontier (docs/results/frontier.md): the best served-correct
# goodput on the tuning suite; what it costs on the held-out suites is on that page and in docs/concepts.md.
SHIPPED_BUDGET = 0.25


class VTokenConfig(BaseModel):
    """How (and whether) a vLLM engine evicts tokens and reclaims their blocks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["off", "naive", "vtoken"] = Field(
        "vtoken",
        description="off: stock vLLM. naive: evict tokens but hold every block that still has a live "
        "token at its original position (the Naive-Evict baseline). vtoken: evict and repack, freeing blocks.",
    )
    policy: str = Field(
        "snapkv",
        description="eviction policy: snapkv (the default: h2o's attention pooled over neighbouring tokens, keeps "
        "facts whole while a prompt is read), h2o, scissorhands, random, streaming",
    )
    budget: float = Field(
        SHIPPED_BUDGET,
        allow_inf_nan=False,
        description="live tokens kept per request: a ratio (< 1) of the context, or a count",
    )
    interval: int | Literal["block"] = Field(
        "block",
        description="while decoding, a request decides (and compacts) once it holds this many tokens more than its "
        "budget keeps, then evicts back to it at once: 1 decides at every decode step; block (the default) once per "
        "KV block, so decisions and compactions come about once per block and a request holds at most one block "
        "more than its budget",
    )
    sink: int = Field(4, ge=0, description="first tokens never evicted (attention sinks)")
    recent: int = Field(16, ge=0, description="most recent tokens never evicted")
    seed: int = Field(0, ge=0, le=2**64 - 1, description="seed for randomised policies")
    policy_params: dict[str, Any] = Field(
        default_factory=dict,
        description="the policy's own parameters, each of its declared type and range, e.g. scissorhands' "
        "{'history': 32} (1-64), snapkv's {'before': 12, 'after': 2} (0-4096), h2o's {'score_every': 4}",
    )
    prefill_evict: bool = Field(
        True,
        description="evict at every prefill chunk boundary too, so a long prompt never holds more than its budget "
        "plus one chunk (h2o and scissorhands score the chunk's last `prefill_window` queries). Off: the first "
        "eviction comes after the prompt (random, streaming) or after the first decode step (h2o, scissorhands)",
    )
    prefill_window: int = Field(
        32,
        ge=1,
        description="h2o/scissorhands with prefill_evict: queries at the end of each prefill chunk whose "
        "attention seeds the statistics (SnapKV's observation window)",
    )
    decode_window: int = Field(
        16,
        ge=1,
        le=256,
        description="snapkv while decoding: the request's last queries kept (per layer, on the device) and scored "
        "once over its live keys just before a decision (SnapKV's observation window over decode queries)",
    )
    evict: Literal["always", "pressure"] = Field(
        "pressure",
        description="pressure (the default): the budget is a floor, not a target: a request keeps every token while "
        "the pool holds what runs and what waits (with pressure_watermark); when it runs short, the requests give "
        "back what the shortfall needs, the fewest tokens first, never below their budgets (vtoken/core/shedding.py), "
        "and a request still reading its prompt parks what it sheds. always: every request keeps to its budget "
        "(evicting between prefill chunks with prefill_evict), so its peak is bounded",
    )
    pressure_watermark: float = Field(
        0.02, ge=0, lt=1, description="evict: pressure: the share of the pool's blocks kept free on top of the demand"
    )
    pressure_floor: float = Field(
        0.0,
        ge=0,
        le=1,
        description="evict: pressure: the share of its tokens a request keeps at least when the pool runs short for "
        "a request that waits. A waiting request is admitted only while every running request and it fit in the pool "
        "at this share of their tokens (vtoken/core/shedding.py admissible); otherwise it waits, and answers are not "
        "traded for concurrency below it. The running requests' own growth may still take them down to their "
        "budgets (never a preemption). 0 (the default): the budget is the only floor, the most requests run at once. "
        "Per request too: a request's own floor is kept by every admission while it runs, whatever the others ask",
    )
    park_tokens: int | Literal["auto"] = Field(
        "auto",
        description="tokens of the parking tier, outside the KV pool (host memory): every token a request gives up "
        "(a prefill chunk boundary, a shed, a decode decision) waits there; the prompt's last chunk attends the "
        "live and the parked tokens, the tokens kept are chosen among both by its window (the question), and while "
        "decoding they come back by recall (recall_every) or when the pool has room again; attention policies "
        "(h2o, scissorhands, snapkv). Admission reserves what each request may park. auto (the default): on a CPU "
        "four times the tokens the KV pool holds; on a GPU pinned host memory, park_host_memory of the machine's "
        "memory (shared by its tensor-parallel ranks), at most four times the pool's tokens. 0: no tier, what is "
        "given up is lost; a full tier frees its oldest parked tokens first",
    )
    recall_every: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="recall while decoding: a request with parked tokens has its window of recent decode queries "
        "scored over its live and parked keys every this many decode steps (and at each of its decisions), and "
        "chooses again among both: parked winners come back into the pool, live losers park. 0 (the default: on "
        "the frontier it bought no needle and cost requests per second, docs/results/frontier.md): never (what is "
        "parked comes back only with the question, or when the pool has room again). Needs the tier and a policy "
        "that scores a window (snapkv, the default)",
    )
    recall_exact: bool = Field(
        False,
        description="recall scores every parked token exactly (reads all their keys) instead of first bounding "
        "their pages with min/max key boxes and scoring only the best pages' tokens (the summary path, what a GPU "
        "reads over PCIe); tests and benchmarks compare the two",
    )
    park_host_memory: float = Field(
        0.25,
        gt=0,
        le=0.9,
        description="park_tokens auto on a GPU: the share of the host's memory the parking tier may pin",
    )

    @field_validator("interval")
    @classmethod
    def _interval(cls, v: int | str) -> int | str:
        if v != "block" and v < 1:
            raise ValueError(f"interval must be 'block' or >= 1, got {v}")
        return v

    @field_validator("park_tokens")
    @classmethod
    def _park_tokens(cls, v: int | str) -> int | str:
        if v != "auto" and v < 0:
            raise ValueError(f"park_tokens must be 'auto' or >= 0, got {v}")
        return v

    def tier_tokens(self, pool_tokens: int, device: str, token_bytes: int = 0, ranks: int = 1) -> int:
        """The parking tier's size for a KV pool of ``pool_tokens`` tokens on ``device`` ("cpu", "cuda"; 0: no
        tier); ``token_bytes``: one token's KV on one rank (every layer), ``ranks``: tensor-parallel ranks on this
        host. The scheduler and the worker both call this with the same figures, so they agree."""
        if self.park_tokens != "auto":
            return int(self.park_tokens)
        if device == "cpu":
            return 4 * pool_tokens
        if token_bytes <= 0:
            return 0
        host = int(host_memory_bytes() * self.park_host_memory) // (token_bytes * max(ranks, 1))
        return min(host, 4 * pool_tokens)

    prefill_chunk: int | None = Field(
        None,
        ge=1,
        description="largest prefill forward of a request while others run or wait, in tokens (vLLM's "
        "long_prefill_token_threshold, chunked prefill); a request alone may take the step's whole budget, "
        "max_num_batched_tokens. null: vLLM's own (a prompt shorter than the step budget is one chunk)",
    )
    trace_path: str | None = Field(
        None,
        description="write one JSON line per finished request: the caller's request id, prompt and output token "
        "ids, the prefill chunks, and the forward at which each evicted token died (an audit trail). An existing "
        "file is refused unless trace_append is set",
    )
    trace_append: bool = Field(False, description="append to an existing trace_path instead of refusing it")
    collect_scores: bool = Field(
        False,
        description="collect attention statistics even when the engine's "
        "policy needs none, so that single requests may choose h2o or scissorhands",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        """YAML 1.1 reads a bare ``off`` as the boolean false: ``mode: off`` means mode "off"."""
        return "off" if v is False else v

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from vtoken.core.policies import POLICIES

        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r}; known: {', '.join(sorted(POLICIES))}")
        return v

    def make_policy(self) -> EvictionPolicy:
        """The policy these options make; a ValueError whose message starts with the option at fault
        (``policy_params.history: must be a whole number, got str 'a'``)."""
        own = {"budget", "interval", "sink", "recent", "seed"}
        for key in sorted(own & set(self.policy_params)):
            raise ValueError(f"policy_params.{key}: set {key} itself, not inside policy_params")
        try:
            return make_policy(
                self.policy,
                budget=self.budget,
                interval=0 if self.interval == "block" else self.interval,
                sink=self.sink,
                recent=self.recent,
                seed=self.seed,
                **self.policy_params,
            )
        except PolicyParamError as e:
            where = e.param if e.param in own else f"policy_params.{e.param}"
            raise ValueError(f"{where}: {e.reason}") from None

    def for_request(self, overrides: dict[str, Any] | None) -> VTokenConfig:
        """This config with one request's choices applied (see ``request_args``); raises ValueError."""
        if not overrides:
            return self
        unknown = set(overrides) - REQUEST_KEYS
        if unknown:
            raise ValueError(
                f"vtoken request options {sorted(unknown)} are not per-request; "
                f"a request may set {sorted(REQUEST_KEYS)}"
            )
        cfg = VTokenConfig(**{**self.model_dump(), **overrides})  # validated (model_copy would not)
        if overrides.get("pressure_floor") and cfg.evict != "pressure":
            raise ValueError(
                "pressure_floor: a floor is kept in pressure mode only; this request evicts always (it keeps to its "
                'budget): ask "evict": "pressure" with it, or leave it out'
            )
        needs = set(cfg.make_policy().needs)
        if needs and not (self.collect_scores or self.make_policy().needs):
            raise ValueError(
                f"policy {cfg.policy!r} needs attention statistics this engine does not collect; "
                "start it with collect_scores=True or an attention policy"
            )
        return cfg

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @classmethod
    def from_vllm(cls, vllm_config) -> VTokenConfig:
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        return cls(**raw) if raw else cls(mode="off")

    def model_post_init(self, _ctx: Any) -> None:
        self.make_policy()  # validate the policy parameters now, in the user's process


def host_memory_bytes() -> int:
    """The memory this process may use on its host: the machine's, or its container's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(limit).read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


class RequestConfigs:
    """Each request's own config (``SamplingParams.extra_args["vtoken"]``) and the policy it makes, cached by
    option set with a bound: a server whose clients send many different option sets must not grow without end.

    An option set this engine cannot honour is logged and answered with the engine's own config: raising in the
    scheduler would stop the engine for every request (clients validate with ``request_args`` first)."""

    def __init__(self, engine: VTokenConfig, maxsize: int = 256) -> None:
        self.engine, self.maxsize = engine, maxsize
        self._cache: collections.OrderedDict[str, tuple[EvictionPolicy, VTokenConfig]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, options: dict[str, Any] | None, request_id: str = "") -> tuple[EvictionPolicy, VTokenConfig]:
        try:
            key = json.dumps(options, sort_keys=True) if options else ""
        except (TypeError, ValueError):  # keys of mixed types, values JSON cannot say: still one key per value
            key = repr(options)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        try:
            cfg = self.engine.for_request(options)
        except (ValueError, TypeError) as e:
            logger.error("vtoken: request %s: %s; using the engine's policy", request_id, e)
            cfg = self.engine
        hit = self._cache[key] = (cfg.make_policy(), cfg)
        if len(self._cache) > self.maxsize:
            self._cache.popitem(last=False)
        return hit


def request_args(**overrides: Any) -> dict[str, Any]:
    """``SamplingParams(extra_args=request_args(policy="h2o", budget=0.25))``: one request's own policy and
    budget. Checked here against the defaults; the engine checks again against its own config."""
    VTokenConfig(collect_scores=True).for_request(overrides)
    return {CONFIG_KEY: dict(overrides)}
