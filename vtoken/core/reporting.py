"""What the compactor reports: the engine's figures for tests and benchmarks (``core_stats``, which walks every
request), and a few numbers for a replica's frequent pool report (``core_report``, O(requests + blocks)).
Plain Python; reads the requests' states and the engine's counters (vtoken/core/records.py), changes nothing but
the counters a ``reset`` starts afresh.

``blocks_of(rid)`` is the compactor's: the request's block list (vLLM's ``req_to_blocks[rid]``). Blocks are
counted as a request holds them: its list, plus its ballast in naive mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from vtoken.core.park import TierSlots
from vtoken.core.records import EngineTotals
from vtoken.core.request_state import RequestState


class CoreReport(NamedTuple):
    """The compactor in a few numbers, for a replica's frequent pool report: O(requests + blocks)."""

    live_tokens: int
    retained_blocks: int  # blocks the requests hold (naive mode: with the ballast)
    naive_retained_blocks: int  # what Naive-Evict would hold for the same live tokens
    admitted: tuple[str, ...]  # the callers' ids of the requests it tracks
    blocks_freed: int  # counters since the engine started
    tokens_evicted: int
    tokens_moved: int
    compaction_seconds: float
    preemptions: int
    parked_tokens: int = 0  # in the tier now
    tier_tokens: int = 0  # the tier's size (0: none)
    tokens_recalled: int = 0  # counters since the engine started
    recalls: int = 0
    recall_bytes: int = 0


def pool_totals(states: Iterable[RequestState], blocks_of: Callable[[str], list]) -> tuple[int, int, int]:
    """(live tokens, retained blocks, Naive-Evict's blocks) over every request: O(requests + blocks)."""
    live = retained = naive = 0
    for st in states:
        live += st.table.num_live
        retained += len(blocks_of(st.request_id)) + len(st.ballast)
        naive += st.table.naive_blocks()
    return live, retained, naive


def core_stats(
    states: dict[str, RequestState],
    blocks_of: Callable[[str], list],
    totals: EngineTotals,
    block_size: int,
    tier: TierSlots | None,
    reset: bool = False,
    running: int = 0,
) -> dict[str, Any]:
    """Per-request figures and the engine's totals (vtoken/core/records.py). Walks every request: for tests and
    benchmarks. ``reset``: afterwards start peak_running (at ``running``) and the finished list afresh."""
    reqs = {}
    for rid, st in states.items():
        reqs[st.record.request_id] = st.record.snapshot(st.table, len(blocks_of(rid)), len(st.ballast))
    out = {"requests": reqs, **totals.summary(reqs, block_size)}
    out["parked_tokens"] = sum(st.parked.size for st in states.values())
    out["tier_tokens"] = tier.capacity if tier is not None else 0
    if reset:
        totals.peak_running = running
        totals.finished.clear()
    return out


def core_report(
    states: dict[str, RequestState], blocks_of: Callable[[str], list], totals: EngineTotals, tier: TierSlots | None
) -> CoreReport:
    """The compactor in a few numbers (``CoreReport``): O(requests + blocks)."""
    live, retained, naive = pool_totals(states.values(), blocks_of)
    admitted = tuple(sorted(st.record.request_id for st in states.values()))
    t = totals
    parked = sum(st.parked.size for st in states.values())
    return CoreReport(live, retained, naive, admitted, t.blocks_freed, t.tokens_evicted, t.tokens_moved,
                      t.compaction_seconds, t.preemptions, parked, tier.capacity if tier else 0,
                      t.tokens_recalled, t.recalls, t.recall_bytes)  # fmt: skip
