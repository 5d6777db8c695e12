"""PoolReport: an engine's KV pool in a few numbers, for replicas, the controller, metrics and routers. A plain
NamedTuple without torch or vLLM, so everything that reads reports (the controller, the gateway) imports nothing
heavy; the vLLM adapter's scheduler fills it (vtoken/vllm_adapter/scheduler.py vtoken_pool_report)."""

from __future__ import annotations

from typing import NamedTuple


class PoolReport(NamedTuple):
    """EngineCore -> its client (a replica, a metrics exporter): the engine's KV pool in a few numbers.

    Cheap by construction: O(running requests) small integer sums, no per-token work, no request records.
    Counters (``*_total``) only grow for the engine's life; the rest describe this moment.
    """

    free_blocks: int  # blocks vLLM's pool can hand out now
    total_blocks: int  # usable blocks in the pool (vLLM's null block excluded)
    kv_cache_usage: float  # vLLM's own figure: 1 - free / total
    running: int
    waiting: int
    live_tokens: int  # live tokens over running requests
    retained_blocks: int  # blocks running requests hold (naive mode: with its ballast)
    naive_retained_blocks: int  # blocks Naive-Evict would hold for the same live tokens
    blocks_reclaimed: int  # naive_retained_blocks - retained_blocks, never below 0
    admitted: tuple[str, ...]  # caller ids of the requests whose blocks these figures count, sorted
    blocks_freed_total: int  # blocks returned to the pool by compaction
    tokens_evicted_total: int
    tokens_moved_total: int
    compaction_seconds_total: float  # scheduler-side eviction + planning time
    preemptions_total: int

    block_size: int
    # Work left in tokens: what running requests have still to read of their prompts and to generate (up to
    # their max_tokens), a measure of how long the replica stays busy that counts a long request as long.
    tokens_to_go: int = 0
    # The parking tier (host memory): tokens parked now, its size, and since the engine started the tokens brought
    # back while decoding (recall), recalls made, and parked bytes read to score them.
    parked_tokens: int = 0
    tier_tokens: int = 0
    tokens_recalled_total: int = 0
    recalls_total: int = 0
    recall_bytes_total: int = 0

    @classmethod
    def from_wire(cls, fields) -> PoolReport:
        """vLLM's utility RPC carries a NamedTuple as a plain sequence (msgpack, tuples become lists)."""
        r = cls._make(fields)
        return r._replace(admitted=tuple(r.admitted))

    @property
    def fragmentation(self) -> float:
        """Share of the retained blocks' slots that hold no live token."""
        cap = self.retained_blocks * self.block_size
        return 0.0 if not cap else max(0.0, 1.0 - self.live_tokens / cap)
