"""VTokenConfig: the one switch users set. Travels to vLLM's EngineCore and workers inside
``VllmConfig.additional_config["vtoken"]``, so every process builds the same policy."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vtoken.policies import EvictionPolicy, make_policy

CONFIG_KEY = "vtoken"


class VTokenConfig(BaseModel):
    """How (and whether) a vLLM engine evicts tokens and reclaims their blocks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["off", "naive", "vtoken"] = Field(
        "vtoken", description="off: stock vLLM. naive: evict tokens but hold every block that still has a live "
        "token at its original position (the Naive-Evict baseline). vtoken: evict and repack, freeing blocks.")
    policy: str = Field("h2o", description="eviction policy: h2o, scissorhands, random, streaming")
    budget: float = Field(0.5, description="live tokens kept per request: a ratio (< 1) of the context, or a count")
    interval: int = Field(1, ge=1, description="evict every N decode steps")
    sink: int = Field(4, ge=0, description="first tokens never evicted (attention sinks)")
    recent: int = Field(16, ge=0, description="most recent tokens never evicted")
    seed: int = Field(0, description="seed for randomised policies")
    policy_params: dict[str, Any] = Field(default_factory=dict,
                                          description="extra policy parameters, e.g. {'history': 32}")
    trace_path: str | None = Field(None, description="append one JSON line per finished request: prompt and "
                                   "output token ids and the decode step at which each evicted token died")
    relocate_every: int = Field(0, ge=0, description="testing: every N decode steps move every request's KV "
                                "into fresh blocks (same slot order); outputs must not change. 0 = never")
    fault: Literal["skip_moves", "physical_rope"] | None = Field(
        None, description="testing only, negative controls: skip the KV copies, or feed physical positions to "
        "RoPE; both must break exactness")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from vtoken.policies import POLICIES
        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r}; known: {', '.join(sorted(POLICIES))}")
        return v

    def make_policy(self) -> EvictionPolicy:
        return make_policy(self.policy, budget=self.budget, interval=self.interval, sink=self.sink,
                           recent=self.recent, seed=self.seed, **self.policy_params)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @classmethod
    def from_vllm(cls, vllm_config) -> "VTokenConfig":
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        return cls(**raw) if raw else cls(mode="off")

    def model_post_init(self, _ctx: Any) -> None:
        self.make_policy()  # validate the policy parameters now, in the user's process
