"""EvictionPolicy: the shared mechanics of every token-eviction policy.

A policy only DECIDES which logical tokens die; it never touches memory (the TokenTable, the compaction
planner and the mover do), and it never decides WHEN (vtoken/core/schedule.py does: ``select`` is asked only at a
decision point). Subclasses implement one method, ``score``: higher means keep. The base class does the rest: how
many tokens to keep (``budget``, an absolute count or a ratio of the context, vtoken/core/budget.py), which tokens are
never candidates (the first ``sink`` tokens, the last ``recent`` tokens, and tokens the engine marks protected,
e.g. in shared prefix blocks), and the top-k selection. ``interval`` and ``score_every`` are timing parameters
carried here because users set them with the policy; only ``Schedule`` reads them. Decisions are a pure function
of the PolicyInput, so every tensor-parallel rank, and the naive and vtoken modes, reach the same decision from the
same input.
"""

from __future__ import annotations

import functools
import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import numpy as np

from vtoken.core.budget import target_tokens

# Names of the per-token statistics an engine can provide (aligned with PolicyInput.live).
ATTN_SUM = "attn_sum"  # float: attention weight the token received, summed over heads, layers, steps
ATTN_HIST = "attn_hist"  # int64 bit register: bit j set if, j observed queries ago, the token's share of that
# query's attention exceeded the uniform share 1 / (keys the query attends to) (bit 0 = the latest query; a
# decode step is one query, a prefill chunk's observation window several; see vtoken/kv/scores.py)


class PolicyParamError(ValueError):
    """A policy parameter of the wrong type or out of its range; ``param`` names it, ``reason`` says why."""

    def __init__(self, policy: str, param: str, reason: str):
        super().__init__(f"{policy}: {param}: {reason}")
        self.policy, self.param, self.reason = policy, param, reason


def param(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A policy parameter with its range: ``history: int = param(32, ge=1, le=64)``. Its type is its annotation
    (``int``: a whole number, never a bool; ``float``: any finite number). Every policy checks its values
    against both when it is made (``EvictionPolicy.__post_init__``), so a request's wrong ``policy_params`` is a
    clear error at the door, never an exception inside the engine's scheduler."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le})


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_param(policy: str, name: str, value: Any, kind: Any, bounds: dict[str, float | None]) -> None:
    """Raise PolicyParamError unless ``value`` is a ``kind`` (int or float) within ``bounds`` (ge, gt, le)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        want = "a whole number" if kind is int else "a number"
        raise PolicyParamError(policy, name, f"must be {want}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise PolicyParamError(policy, name, f"must be a finite number, got {value}")
    lo, lo_open, hi = bounds.get("ge"), bounds.get("gt"), bounds.get("le")
    if (lo is not None and value < lo) or (lo_open is not None and value <= lo_open) or (hi is not None and value > hi):
        rng = " and ".join(
            f"{op} {b}" for op, b in ((">=", lo), (">", lo_open), ("<=", hi)) if b is not None
        )  # fmt: skip
        raise PolicyParamError(policy, name, f"must be {rng}, got {value}")


class PolicyInput(NamedTuple):
    """What a policy sees for one request at one decode step. Arrays are aligned with ``live``."""

    num_logical: int  # tokens so far (prompt + output), the "context"
    step: int  # the decision's policy step (Schedule.decision_step: the decode step, 0 at a chunk boundary or shed)
    live: np.ndarray  # int64 logical positions of live tokens, ascending
    stats: dict[str, np.ndarray] = {}  # statistics named in the policy's ``needs``
    protected: np.ndarray | None = None  # bool: token may not be evicted (shared block, ...)
    request_seed: int = 0  # stable per-request number, for randomised policies


@dataclass(frozen=True)
class EvictionPolicy(ABC):
    """Base class. ``budget`` < 1 is a ratio of the context; >= 1 an absolute number of tokens."""

    budget: float = param(0.5, gt=0)
    # Timing (Schedule): a decoding request decides once it holds ``interval`` tokens more than it keeps (1: at
    # every decode step; 0: one KV block, the engine's default, so decisions and compactions come in batches).
    interval: int = param(1, ge=0)
    sink: int = param(4, ge=0)
    recent: int = param(16, ge=0)
    seed: int = param(0, ge=0, le=2**64 - 1)  # NumPy's generators take seeds of 0 to 2**64 - 1
    # Per-step attention policies only, opt-in: observe one decode step in ``score_every`` (the engine then
    # exports statistics, and the policy evicts, only after an observed step). 1 = every step, exact H2O /
    # Scissorhands; k > 1 cuts the scorer's cost k-fold at the quality cost in docs/results/quality_score_every.md.
    score_every: int = param(1, ge=1)
    needs: ClassVar[tuple[str, ...]] = ()  # statistics the engine must collect for this policy
    # The decode statistics come from the window of the request's recent queries, scored once just before a
    # decision (SnapKV's observation window); False: every decode step's attention, accumulated (H2O's definition).
    window_scores: ClassVar[bool] = False
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        types = _types(type(self))
        for f in fields(self):
            check_param(self.name, f.name, getattr(self, f.name), types[f.name], f.metadata)
        if self.budget >= 1 and float(self.budget) != int(self.budget):
            raise PolicyParamError(self.name, "budget", f"a budget >= 1 is a token count and must be whole, got "
                                   f"{self.budget}")  # fmt: skip
        if self.score_every != 1 and (not self.needs or self.window_scores):
            raise PolicyParamError(
                self.name, "score_every", "applies only to per-step attention policies (h2o, scissorhands)"
            )

    def target(self, num_logical: int) -> int:
        """Live tokens to keep for a context of ``num_logical`` tokens."""
        return target_tokens(num_logical, self.budget)

    @abstractmethod
    def score(self, inp: PolicyInput) -> np.ndarray:
        """One float per live token (aligned with ``inp.live``): higher means more worth keeping."""

    def ranked(self, inp: PolicyInput) -> np.ndarray:
        """The live tokens the policy may evict (not sink, recent or protected), least worth keeping first (int64
        logical positions). Stable: among equal scores the oldest token comes first, identically on every rank."""
        live = np.asarray(inp.live, dtype=np.int64)
        keep = (live < self.sink) | (live >= inp.num_logical - self.recent)
        if inp.protected is not None:
            keep |= np.asarray(inp.protected, dtype=bool)
        candidates = np.flatnonzero(~keep)
        if candidates.size == 0:
            return np.empty(0, dtype=np.int64)
        scores = np.asarray(self.score(inp), dtype=np.float64)[candidates]
        return live[candidates[np.argsort(scores, kind="stable")]]

    def select(self, inp: PolicyInput, keep: int | None = None) -> np.ndarray:
        """Logical positions to evict now (int64, ascending) so that ``keep`` live tokens stay (default: the
        budget's target); empty when nothing needs to go. Called only at a decision point (vtoken/core/schedule.py)."""
        excess = len(inp.live) - (self.target(inp.num_logical) if keep is None else keep)
        if excess <= 0:
            return np.empty(0, dtype=np.int64)
        return np.sort(self.ranked(inp)[:excess])
