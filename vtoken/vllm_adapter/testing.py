"""Testing knobs for vToken's own tests: negative controls and relocation. Never reachable from a serving config.

    from vtoken.vllm_adapter import testing
    with testing.open_llm(model, VTokenConfig(...), testing.Knobs(fault="skip_moves"), block_size=32) as llm: ...

The public ``engine_kwargs`` refuses ``additional_config["vtoken_testing"]``, and VTokenConfig has no such
fields, so a serve config cannot switch them on. This module swaps in subclasses of vToken's scheduler and
worker; the serving classes carry no testing code.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vtoken.config import VTokenConfig
from vtoken.core.move_batch import MoveBatch
from vtoken.core.planner import to_global_slots
from vtoken.core.step import StepPlan
from vtoken.kv.mover import Mover
from vtoken.vllm_adapter import engine as engine_mod
from vtoken.vllm_adapter.engine import TESTING_KEY
from vtoken.vllm_adapter.faults import FAULTS, FaultyTensorParallel
from vtoken.vllm_adapter.scheduler import VTokenScheduler, external_id
from vtoken.vllm_adapter.worker import VTokenCPUWorker, gpu_worker_cls


class Knobs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    fault: (
        Literal[
            "skip_moves", "physical_rope", "fail_rank1_moves", "scores_rank0_only", "blind_last_chunk", "cache_dirty"
        ]
        | None
    ) = Field(
        None,
        description="negative controls: skip the KV copies, or feed physical positions to RoPE (both must break "
        "exactness); TP rank 1 raises while applying a plan (the engine must stop), or attention statistics "
        "from rank 0's heads only (H2O's decisions must change); parking's last chunk does not attend the "
        "parked tokens although the trace says it does (exactness must break); blocks that lost or gained tokens "
        "stay in the prefix cache and are offered as hits (exactness must break)",
    )
    relocate_every: int = Field(
        0,
        ge=0,
        description="every N decode steps move every request's KV into fresh blocks (same slot order); "
        "outputs must not change. 0 = never",
    )
    fail_request: str | None = Field(
        None,
        description="the request with this caller id gets a policy that raises whenever it decides (or sheds): "
        "it must end alone, with finish reason 'error', while the others run on exact",
    )

    @classmethod
    def from_vllm(cls, vllm_config) -> Knobs:
        return cls(**((getattr(vllm_config, "additional_config", None) or {}).get(TESTING_KEY) or {}))


def engine_kwargs(vtoken: VTokenConfig | dict, knobs: Knobs, **kwargs: Any) -> dict[str, Any]:
    kw = engine_mod.engine_kwargs(vtoken, **kwargs)
    if "scheduler_cls" not in kw:
        raise ValueError("testing knobs need vToken on (mode naive or vtoken)")
    kw["additional_config"][TESTING_KEY] = knobs.model_dump()
    kw["scheduler_cls"] = f"{__name__}.TestingScheduler"
    kw["worker_cls"] = f"{__name__}.{'TestingCPUWorker' if engine_mod._platform() == 'cpu' else 'TestingGPUWorker'}"
    return kw


@contextlib.contextmanager
def open_llm(model: str, vtoken: VTokenConfig | dict, knobs: Knobs, **kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(model=model, **engine_kwargs(vtoken, knobs, **kwargs))
    try:
        yield llm
    finally:
        engine_mod.shutdown_llm(llm)


class TestingScheduler(VTokenScheduler):
    """Relocation: every ``relocate_every`` decode steps, a request that is not compacted in this step has every
    slot moved into the same slot of fresh blocks, and its old blocks are freed."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.vt_knobs = Knobs.from_vllm(vllm_config)
        self.vt_replace: dict[str, list[int]] = {}
        if self.vt_knobs.fault == "cache_dirty":  # negative control: compacted blocks keep (or get) their hashes
            self.vt_core.may_cache = lambda rid: True
            self.vt_pool.evict_blocks = lambda ids: None

    def _vt_before_schedule(self, plan: StepPlan) -> StepPlan:
        self.vt_replace = {}
        every = self.vt_knobs.relocate_every
        if not every:
            return plan
        moves = [plan.moves]
        for request in self.running:
            rid = request.request_id
            length = self.vt_core.decoding_len(rid)
            if length is None or rid in plan.keep_blocks or request.num_output_tokens % every:
                continue
            old = self.vt_manager.req_to_blocks[rid]
            if len(old) > self.vt_pool.get_num_free_blocks():
                continue
            new = self.vt_pool.get_new_blocks(len(old))
            slots = np.arange(length)
            self.vt_core.note_worker(0.0, 0, tokens_moved=slots.size)
            moves.append(
                MoveBatch(
                    to_global_slots(slots, [b.block_id for b in old], self.vt_bs),
                    to_global_slots(slots, [b.block_id for b in new], self.vt_bs),
                )
            )
            freed = list(old)
            old[:] = new  # the same list object: vLLM and the compactor both hold it
            self.vt_pool.free_blocks(reversed(freed))
            self.vt_replace[rid] = [b.block_id for b in new]
        return plan._replace(moves=MoveBatch.concat(moves))

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        out.vtoken_testing = {"replace_blocks": self.vt_replace}
        return out

    def _policy_for(self, request):
        policy, opts = super()._policy_for(request)
        if self.vt_knobs.fail_request is not None and external_id(request.request_id) == self.vt_knobs.fail_request:
            policy = _raising(policy)
        return policy, opts


def _raising(policy):
    """The same policy, except that it raises whenever it scores (a policy's bug, as the engine would meet it)."""

    def score(self, inp):
        raise RuntimeError("injected fault (testing.Knobs.fail_request): this policy cannot decide")

    cls = type(f"Raising{type(policy).__name__}", (type(policy),), {"score": score})
    return cls(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


class TestingRunnerMixin:
    def _vt_setup(self) -> None:
        super()._vt_setup()
        self.vt_knobs = Knobs.from_vllm(self.vllm_config)
        self.vt_tp = FaultyTensorParallel(self.vt_tp.group, self.vt_knobs.fault)  # before the scorer takes it

    def _vt_step_mover(self) -> Mover:
        if self.vt_knobs.fault == "skip_moves":
            return SKIP_MOVES
        return super()._vt_step_mover()

    def _vt_apply(self, step, so) -> None:
        super()._vt_apply(step, so)
        if self.vt_tier is not None:  # negative control: the last chunk does not attend the parked tokens
            self.vt_tier.attend = self.vt_knobs.fault != "blind_last_chunk"
        for rid, blocks in getattr(so, "vtoken_testing", {}).get("replace_blocks", {}).items():
            self._vt_set_blocks(rid, lambda ids, blocks=blocks: blocks)

    def _vt_physical_positions(self, total, physical) -> None:
        if self.vt_knobs.fault == "physical_rope":  # negative control: RoPE sees physical positions
            self.positions[:total] = physical


class _SkipMoves(Mover):
    """Negative control: a mover that copies nothing (outputs must then break exactness)."""

    def apply(self, kv_caches, batch, extra=()) -> None:
        pass


SKIP_MOVES = _SkipMoves()


class TestingRPC:
    def vtoken_set_fault(self, fault: str | None) -> None:
        """Switch a fault on a running engine (saves an engine start in the tensor-parallel tests)."""
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
        self.model_runner.vt_knobs = self.model_runner.vt_knobs.model_copy(update={"fault": fault})
        self.model_runner.vt_tp.fault = fault


class TestingCPUWorker(TestingRPC, VTokenCPUWorker):
    runner_mixins = (TestingRunnerMixin,)


def __getattr__(name: str):
    if name == "TestingGPUWorker":
        return gpu_worker_cls(TestingRunnerMixin, rpc=(TestingRPC,))
    raise AttributeError(name)
