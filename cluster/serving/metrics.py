"""Prometheus metrics for ``GET /metrics``: vLLM's names and meanings where vLLM has one, vToken's own under
``vtoken:``. One registry per server (no global state: two servers in one process, as in tests, never share
a series). Two sources:

* measured at the gateway, per request, labelled by the replica that served it: time to first token,
  inter-token latency, end-to-end latency, prompt and generation tokens, finished requests by reason, and
  requests by front door and outcome (``vtoken:requests_total{door, status}``);
* read from the controller's snapshot at each scrape (``ClusterCollector``), one series per replica: the
  engine's PoolReport (running, waiting, KV usage, preemptions, vToken's reclaimed / retained / naive-retained
  blocks, live tokens, fragmentation, tokens moved and evicted, compaction seconds), vLLM's prefix-cache queries
  and hits and the blocks placement knows its prefix cache holds, plus placements by strategy and scaling decisions.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's own buckets, imported (not copied): dashboards built for vLLM read ours alike, and the two never drift.
from vllm.v1.metrics.buckets import INTER_TOKEN_LATENCY_BUCKETS as ITL_BUCKETS
from vllm.v1.metrics.buckets import REQUEST_LATENCY_BUCKETS as E2E_BUCKETS
from vllm.v1.metrics.buckets import TIME_TO_FIRST_TOKEN_BUCKETS as TTFT_BUCKETS

from actors.wire import Chunk
from cluster.control.snapshot import ClusterSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LABELS = ("model_name", "replica")


class Metrics:
    """The server's registry. ``timer()`` measures one request; ``render(snapshot)`` is one scrape."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, at the gateway", LABELS, buckets=TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between two streamed chunks of a request, at the gateway",
            LABELS, buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival at the gateway to the last token, completed requests",
            LABELS, buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", LABELS, registry=r)
        self.success = Counter(
            "vllm:request_success", "Completed requests by finish reason", (*LABELS, "finished_reason"), registry=r
        )
        self.requests = Counter(
            "vtoken:requests",
            "Requests by front door (http, grpc) and outcome (ok, cancelled by the client, or the error code)",
            ("door", "status"),
            registry=r,
        )
        self.inflight = Gauge("vtoken:inflight_requests", "Requests admitted by the gateway, both doors", registry=r)
        self.cluster = ClusterCollector(model_name)
        r.register(self.cluster)

    def timer(self, door: str, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, door, prompt_tokens)

    def refused(self, door: str, status: str) -> None:
        """A request that ended before admission (over max_inflight, invalid, unauthenticated)."""
        self.requests.labels(door, status).inc()

    def render(self, snapshot: ClusterSnapshot | None) -> bytes:
        """One scrape: the gateway's series and the replicas' from ``snapshot`` (the controller's, just read)."""
        self.cluster.snapshot = snapshot
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, labelled by the replica that served it (the last one, after a retry)."""

    def __init__(self, m: Metrics, door: str, prompt_tokens: int):
        self.m, self.door, self.prompt_tokens = m, door, prompt_tokens
        self.t0 = time.monotonic()
        self.last: float | None = None  # time of the last chunk with tokens
        self.replica, self.finish = "", ""
        self._itl = self._tokens = None  # the replica's ITL and token series, set with ``replica``
        m.inflight.inc()

    def chunk(self, replica: str, chunk: Chunk) -> None:
        now, n = time.monotonic(), chunk.tokens
        if replica != self.replica:  # the series of this replica, looked up once per request (not per chunk)
            self.replica, labels = replica, (self.m.model, replica)
            self._itl, self._tokens = self.m.itl.labels(*labels), self.m.generation_tokens.labels(*labels)
        if n:
            if self.last is None:
                labels = (self.m.model, replica)
                self.m.ttft.labels(*labels).observe(now - self.t0)
                self.m.prompt_tokens.labels(*labels).inc(self.prompt_tokens)
            else:
                self._itl.observe(now - self.last)
            self.last = now
            self._tokens.inc(n)
        if chunk.finish_reason:  # n > 1: the last sequence to finish names the request's reason
            self.finish = chunk.finish_reason

    def done(self, outcome: str) -> None:
        self.m.inflight.dec()
        self.m.requests.labels(self.door, outcome).inc()
        if outcome == "ok" and self.replica:
            labels = (self.m.model, self.replica)
            self.m.e2e.labels(*labels).observe(time.monotonic() - self.t0)
            self.m.success.labels(*labels, self.finish or "unknown").inc()


# (name, help, PoolReport field or property, counter?) per replica, from its last report.
POOL_SERIES = (
    ("vllm:num_requests_running", "Requests in the engine's running batch", "running", False),
    ("vllm:num_requests_waiting", "Requests waiting for the engine to admit them", "waiting", False),
    ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100 percent (vLLM's own figure)", "kv_cache_usage", False),
    ("vllm:num_preemptions", "Preemptions in the engine", "preemptions_total", True),
    ("vtoken:free_blocks", "KV blocks the pool can hand out now, vToken's reclaimed ones included", "free_blocks",
     False),
    ("vtoken:total_blocks", "Usable KV blocks in the pool", "total_blocks", False),
    ("vtoken:blocks_reclaimed", "Blocks Naive-Evict would hold but vToken freed, for the same live tokens",
     "blocks_reclaimed", False),
    ("vtoken:retained_blocks", "Blocks the running requests hold", "retained_blocks", False),
    ("vtoken:naive_retained_blocks", "Blocks Naive-Evict would hold for the same live tokens",
     "naive_retained_blocks", False),
    ("vtoken:live_tokens", "Live (not evicted) tokens of the running requests", "live_tokens", False),
    ("vtoken:tokens_to_go", "Tokens the running requests have still to read and generate (work left)",
     "tokens_to_go", False),
    ("vtoken:fragmentation_ratio", "Share of the retained blocks' slots that hold no live token", "fragmentation",
     False),
    ("vtoken:blocks_freed", "Blocks returned to the pool by compaction", "blocks_freed_total", True),
    ("vtoken:tokens_evicted", "Tokens evicted by the policy", "tokens_evicted_total", True),
    ("vtoken:tokens_moved", "Tokens moved by compaction", "tokens_moved_total", True),
    ("vtoken:compaction_seconds", "Scheduler time on eviction and compaction planning", "compaction_seconds_total",
     True),
    ("vtoken:parked_tokens", "Tokens parked in the host tier now (given up, not lost: recall can bring them back)",
     "parked_tokens", False),
    ("vtoken:tier_tokens", "The parking tier's size in tokens (0: no tier)", "tier_tokens", False),
    ("vtoken:tokens_recalled", "Parked tokens brought back while decoding (recall)", "tokens_recalled_total", True),
    ("vtoken:recalls", "Recalls: choices among live and parked tokens while decoding", "recalls_total", True),
    ("vtoken:recall_bytes", "Parked bytes read to score recalls (page boxes and candidates' keys)",
     "recall_bytes_total", True),
)  # fmt: skip


# vLLM's own prefix-cache counters (vllm/v1/metrics/loggers.py), per replica: prompt tokens looked up, and found.
PREFIX_SERIES = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens", "prefix_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens", "prefix_hits"),
)


class ClusterCollector:
    """Per-replica series from the controller's snapshot, which the scrape sets just before collecting. A
    replica restarted with a new engine starts its counters at 0 again (Prometheus reads that as a reset)."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.snapshot: ClusterSnapshot | None = None

    def describe(self):
        return []  # the series depend on the snapshot; nothing to check at registration

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        for name, doc, attr, counter in POOL_SERIES:
            fam = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=LABELS)
            for r in snap.replicas:
                fam.add_metric([self.model, r.name], float(getattr(r.report.pool, attr)))
            yield fam
        for name, doc, attr in PREFIX_SERIES:
            fam = CounterMetricFamily(name, doc, labels=LABELS)
            for r in snap.replicas:
                fam.add_metric([self.model, r.name], float(getattr(r.report, attr)))
            yield fam
        cached = GaugeMetricFamily(
            "vtoken:prefix_cached_blocks",
            "Blocks of the replica's prefix cache that placement knows of (its reports' KV events)", labels=LABELS,
        )  # fmt: skip
        for r in snap.replicas:
            cached.add_metric([self.model, r.name], r.prefix_blocks)
        yield cached
        promised = GaugeMetricFamily(
            "vtoken:promised_blocks", "Blocks of requests placed on the replica that its report does not count yet",
            labels=LABELS,
        )  # fmt: skip
        healthy = GaugeMetricFamily("vtoken:replica_healthy", "1 while the replica takes requests", labels=LABELS)
        # Where each replica runs, as an info series (1, the facts in labels; join on replica), so the other series
        # keep their labels when a replica moves to another node or process.
        info = GaugeMetricFamily(
            "vtoken:replica_info", "Where the replica runs: its Ray node's address and id, and its process",
            labels=(*LABELS, "node_ip", "node_id", "pid", "state"),
        )  # fmt: skip
        for r in snap.replicas:
            promised.add_metric([self.model, r.name], r.promised_blocks)
            healthy.add_metric([self.model, r.name], float(r.state.serving()))
            rep = r.report
            info.add_metric([self.model, r.name, rep.node_ip, rep.node_id, str(rep.pid or ""), str(r.state)], 1.0)
        yield promised
        yield healthy
        yield info
        placed = CounterMetricFamily(
            "vtoken:placements", "Requests placed, by placement strategy and replica", labels=("strategy", "replica")
        )
        for (strategy, replica), n in sorted(snap.placements.items()):
            placed.add_metric([strategy, replica], n)
        yield placed
        scaled = CounterMetricFamily(
            "vtoken:autoscaler_decisions",
            "Changes of the target replica count, by direction (out, in) and trigger (autoscaler, manual)",
            labels=("direction", "trigger"),
        )
        for (direction, trigger), n in sorted(snap.decisions.items()):
            scaled.add_metric([direction, trigger], n)
        yield scaled
