"""ReplicaReport: what a replica tells the controller, a small named type rather than a stats dict.

The engine's figures travel as the adapter's ``PoolReport`` unchanged; the replica adds who it is and
whether it can serve. A replica without a working engine (starting, restarting after its engine died)
reports ``healthy=False`` with an all-zero pool and says why in ``error``.
"""

from __future__ import annotations

from typing import NamedTuple

from vtoken.pool_report import PoolReport


def empty_pool(block_size: int = 0, running: int = 0) -> PoolReport:
    """All figures zero: no engine, or an engine that cannot report its pool (vToken mode off)."""
    return PoolReport(0, 0, 0.0, running, 0, 0, 0, 0, 0, (), 0, 0, 0, 0.0, 0, block_size)


def plain_pool(
    free: int,
    total: int,
    running: int,
    waiting: int,
    live_tokens: int,
    admitted,
    block_size: int,
    tokens_to_go: int,
    reclaimed: int = 0,
    usage: float | None = None,
) -> PoolReport:
    """An engine's pool without vToken's counters (the fake engine, stock vLLM): what it holds, and ``reclaimed``
    blocks Naive-Evict would hold on top (the fake's stand-in for vToken's reclaim). ``usage``: the engine's own
    figure (default: held / total)."""
    held = total - free
    usage = (held / total if total else 0.0) if usage is None else usage
    return PoolReport(free, total, usage, running, waiting, live_tokens, held, held + reclaimed, reclaimed,
                      tuple(sorted(admitted)), 0, 0, 0, 0.0, 0, block_size, tokens_to_go)  # fmt: skip


# An index of a replica's prefix cache holds at most its pool's blocks and this many more: vLLM names one block by
# one hash (a single KV-cache group), so more means missed removals, and the oldest entries go first.
PREFIX_MARGIN = 64


def prefix_capacity(total_blocks: int) -> int:
    """The most block hashes a replica's prefix tracker, or the controller's index of it, keeps."""
    return max(total_blocks, 0) + PREFIX_MARGIN


class PrefixDelta(NamedTuple):
    """What a replica's prefix cache gained and lost since its last delta, as hashes of vtoken/prefix_hash.py (never
    token ids or text). ``seq`` counts the deltas of one incarnation from 1 (an empty delta repeats the last number);
    the controller applies them in order and asks for a snapshot (``full``: ``added`` is everything held, ``removed``
    empty) when one is missing."""

    seq: int
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    full: bool = False


class ReplicaReport(NamedTuple):
    """A replica's state at ``time`` (wall clock). ``incarnation`` changes with every engine the replica
    builds (a new process, or a restart after its engine died), so the controller can tell a new engine
    from a late report of the old one and drop the promises the old one held."""

    name: str
    incarnation: str
    healthy: bool  # an engine that serves
    draining: bool
    inflight: int  # requests in the replica's generate()
    time: float
    pool: PoolReport
    error: str = ""  # why it is not healthy
    # Where it runs, so an operator can find it (vtoken status, /metrics' vtoken:replica_info): its Ray node's
    # address and id, and its process (a new one after every restart).
    node_ip: str = ""
    node_id: str = ""
    pid: int = 0
    # Its prefix cache: the change since the last report (None: its engine cannot tell), and vLLM's counters
    # of prompt tokens looked up in it and found there, since its engine started (vllm:prefix_cache_queries, _hits).
    prefix: PrefixDelta | None = None
    prefix_queries: int = 0
    prefix_hits: int = 0


def unreported(name: str = "") -> ReplicaReport:
    """What the controller knows of a replica before its first report."""
    return ReplicaReport(name, "", False, False, 0, 0.0, empty_pool())
