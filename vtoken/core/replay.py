"""Replay a request's life through the core alone: TokenTable + policy + planner, no engine, no KV bytes.

Given a prompt length and an output length, it applies the policy's decisions after every decode step,
compacts, and records what vToken and Naive-Evict would hold. It is exact for policies whose decisions do
not depend on attention (``random``, ``streaming``); attention-driven policies need the engine (the vLLM
adapter) or a ``stats`` callback that supplies their statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from vtoken.core.accounting import block_counts
from vtoken.core.budget import kept_tokens
from vtoken.core.packing import kill_and_pack
from vtoken.core.policies import EvictionPolicy, PolicyInput
from vtoken.core.records import request_seed
from vtoken.core.schedule import Schedule
from vtoken.core.token_table import TokenTable

__all__ = ["ReplayResult", "replay", "request_seed"]

StatsFn = Callable[[TokenTable, np.ndarray], dict[str, np.ndarray]]


class ReplayResult(NamedTuple):
    logical: int
    live: int
    retained: int  # vToken blocks at the end
    naive_retained: int  # Naive-Evict blocks at the end
    floor: int
    mean_retained: float  # time-averaged over decode steps
    mean_naive_retained: float
    peak_retained: int
    peak_naive_retained: int
    moves: int
    metadata_bytes: int


def replay(
    policy: EvictionPolicy,
    prompt_len: int,
    output_len: int,
    block_size: int,
    request_id: str = "0",
    stats: StatsFn | None = None,
) -> ReplayResult:
    if policy.needs and stats is None:
        raise ValueError(
            f"policy {policy.name!r} needs {list(policy.needs)} from the engine; replay it "
            "through the vLLM adapter or pass a stats callback"
        )
    table = TokenTable(block_size, prompt_len)
    retained, naive, moves = [], [], 0
    seed = request_seed(request_id)
    schedule = Schedule.of(policy, prefill_evict=False)  # decode steps only: the prompt was read at once
    for step in range(1, output_len + 1):
        table.append(1)
        excess = table.num_live - kept_tokens(table.num_logical, policy.budget, policy.sink, policy.recent)
        if schedule.decision_step(table.num_logical, prompt_len, step, excess) is None:
            victims = np.empty(0, np.int64)
        else:
            live = table.live_logical()
            inp = PolicyInput(table.num_logical, step, live, stats(table, live) if stats else {}, None, seed)
            victims = policy.select(inp)
        if victims.size:
            moves += kill_and_pack(table, victims, list(range(table.num_blocks)), block_size).plan.num_moves
        c = block_counts(table)
        retained.append(c.retained)
        naive.append(c.naive_retained)
    c = block_counts(table)
    retained = retained or [c.retained]
    naive = naive or [c.naive_retained]
    return ReplayResult(
        c.logical,
        c.live,
        c.retained,
        c.naive_retained,
        c.floor,
        float(np.mean(retained)),
        float(np.mean(naive)),
        max(retained),
        max(naive),
        moves,
        table.nbytes,
    )
