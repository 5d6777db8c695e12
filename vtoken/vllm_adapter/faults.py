"""Tensor-parallel negative controls, for vToken's own tests only (vllm_adapter/testing.py switches them on).

Kept apart from testing.py because the two-process gloo test (tests/test_tp_exchange.py) uses them without
starting vLLM, and importing vLLM in every rank costs tens of seconds.
"""

from __future__ import annotations

import contextlib

from vtoken.vllm_adapter.tp import TensorParallel

FAULTS = ("skip_moves", "physical_rope", "fail_rank1_moves", "scores_rank0_only", "blind_last_chunk")


class FaultyTensorParallel(TensorParallel):
    """TensorParallel with the two tensor-parallel negative controls, switched by ``fault``."""

    def __init__(self, group=None, fault: str | None = None) -> None:
        super().__init__(group)
        self.fault = fault

    def sum_scores(self, w):
        if self.fault == "scores_rank0_only":  # each rank folds its own heads only: H2O's decisions must change
            return w
        return super().sum_scores(w)

    @contextlib.contextmanager
    def applying(self, step):
        with super().applying(step):
            if self.fault == "fail_rank1_moves" and self.rank == 1 and (len(step.moves) or step.keep_blocks):
                raise RuntimeError("injected fault (testing.Knobs.fault='fail_rank1_moves')")
            yield
