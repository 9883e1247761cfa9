"""Prometheus metrics: each request as the front sees it, and what every worker reports.

Names follow vLLM's (`vllm:time_to_first_token_seconds` is `loopserve:time_to_first_token_seconds`)
so dashboards and alerts written for vLLM carry over; the looped metrics (exit depth, loops)
and the PD ones (KV transfer, leases, migrations) are loopserve's own. Request metrics are
observed where every front (gRPC, HTTP) passes: `Router.generate`. Worker metrics are read
at scrape time from the workers' `stats()`, labelled `worker` and `role`. Each Router owns
its registry, not prometheus_client's process-global one, so several routers in one process
(tests, benchmarks) never collide.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.stats import WorkerStats

PREFIX = "loopserve:"
# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
DEPTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
# Why a request was refused before its first output (Router.generate raises it).
REFUSALS = ("invalid", "backpressure", "unavailable")


class ServingMetrics:
    """The request-level metrics of one router (its front's view: queueing and transfer included)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.success = Counter(f"{PREFIX}request_success", "Requests that ended, by finish reason "
                               "(abort: the client closed or aborted it).", ["finished_reason"], registry=r)
        self.failure = Counter(f"{PREFIX}request_failure", "Requests refused before their first output "
                               "(invalid, backpressure, unavailable) or ended by an engine error.",
                               ["reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of requests that "
                                     "produced output.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens.", registry=r)
        self.migrations = Counter(f"{PREFIX}request_migrations", "Times a request moved to another "
                                  "worker after a worker or engine failure.", registry=r)
        self.routed = Counter(f"{PREFIX}requests_routed", "Requests by where their prompt was "
                              "prefilled: remote (a prefill worker, KV moved), local (pd mode: "
                              "on the decode worker, a short uncached prompt) or colocated.",
                              ["prefill"], registry=r)
        self.routed_cached_tokens = Counter(f"{PREFIX}routed_cached_tokens", "Prompt tokens the "
                                            "chosen worker's prefix cache held when the request "
                                            "was routed (as its KV events told the router).",
                                            registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between two output "
                             "tokens (a chunk of k tokens counts k times its gap / k).",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}request_time_per_output_token_seconds", "A request's mean "
                              "time per output token after the first.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, arrival at "
                             "the router to its last output.", buckets=E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(f"{PREFIX}request_prompt_tokens", "Prompt tokens per "
                                               "request.", buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(f"{PREFIX}request_generation_tokens", "Generated "
                                                   "tokens per request.", buckets=TOKEN_BUCKETS, registry=r)
        self.exit_depth = Histogram(f"{PREFIX}token_exit_depth", "Loops each generated token ran "
                                    "before it exited (its exit depth).", buckets=DEPTH_BUCKETS, registry=r)
        self.loops_per_token = Histogram(f"{PREFIX}request_loops_per_token", "A request's mean exit "
                                         "depth over its generated tokens.", buckets=DEPTH_BUCKETS,
                                         registry=r)

    def begin(self) -> RequestRecord:
        return RequestRecord(self)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        """The exposition text (blocking: worker collectors call the workers)."""
        return generate_latest(self.registry)


class RequestRecord:
    """One request's timeline, fed with its outputs in order; counted once when it ends."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.depths = 0
        self.prompt_tokens = 0
        self.ended = False

    def refused(self, reason: str) -> None:
        """Refused before its first output (one of REFUSALS)."""
        self.ended = True
        self.m.failure.labels(reason).inc()

    def output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.prompt_tokens = out.num_prompt_tokens or self.prompt_tokens
        if n := len(out.new_token_ids):
            if self.last is None:
                self.first = now
                self.m.ttft.observe(now - self.start)
            else:
                for _ in range(n):
                    self.m.itl.observe((now - self.last) / n)
            self.last = now
            self.tokens += n
            self.m.generation_tokens.inc(n)
            for d in out.exit_depths:
                self.m.exit_depth.observe(d)
                self.depths += d
        if out.finished:
            self.finish(out.finish_reason or "abort")

    def finish(self, reason: str) -> None:
        """The request ended: `reason` is its finish reason ('error' counts as a failure)."""
        if self.ended:
            return
        self.ended = True
        if reason == "error":
            self.m.failure.labels("error").inc()
        else:
            self.m.success.labels(reason).inc()
        if self.first is None:
            return
        self.m.prompt_tokens.inc(self.prompt_tokens)
        self.m.request_prompt_tokens.observe(self.prompt_tokens)
        self.m.request_generation_tokens.observe(self.tokens)
        self.m.e2e.observe(self.last - self.start)
        if self.tokens > 1:
            self.m.tpot.observe((self.last - self.first) / (self.tokens - 1))
        if self.depths:
            self.m.loops_per_token.observe(self.depths / self.tokens)


class WorkerCollector(Collector):
    """Gauges and counters from every worker's stats() at scrape time (`stats` blocks on the
    workers: render the registry off the event loop, or fetch them first: `given`)."""

    def __init__(self, stats: Callable[[], dict[str, WorkerStats]]) -> None:
        self._stats = stats
        self._given = threading.local()  # stats fetched by this thread's caller (`given`)

    @contextlib.contextmanager
    def given(self, stats: dict[str, WorkerStats]) -> Iterator[None]:
        """Render with `stats` already fetched (asynchronously) instead of calling the workers."""
        self._given.stats = stats
        try:
            yield
        finally:
            self._given.stats = None

    def collect(self) -> Iterator[Metric]:
        stats = getattr(self._given, "stats", None) or self._stats()
        labels = ["worker", "role"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels + list(extra))

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=labels)

        healthy = gauge("worker_healthy", "1 if the worker answered and its engine has not failed.")
        running = gauge("num_requests_running", "Requests holding an engine slot.")
        waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        receiving = gauge("num_requests_receiving", "Decode side: requests whose KV is being read.")
        transferring = gauge("num_requests_transferring", "Prefill side: requests whose KV awaits "
                             "its reader.")
        usage = gauge("kv_cache_usage_perc", "Fraction of a KV pool's blocks in use (0-1).", ("pool",))
        used = gauge("kv_cache_used_blocks", "KV blocks in use.", ("pool",))
        plane_used = gauge("kv_cache_plane_used_blocks", "Looped-pool blocks held in one KV plane "
                           "(one plane per loop, or one shared).", ("pool", "plane"))
        plane_usage = gauge("kv_cache_plane_usage_perc", "Fraction of the looped pool's blocks held "
                            "in one KV plane (0-1).", ("pool", "plane"))
        handoff = HistogramMetricFamily(
            PREFIX + "handoff_latency_seconds", "Decode side: a handoff's arrival at the worker to "
            "its KV READ done (the wait for blocks plus the READ).", labels=labels)
        loops = counter("loops", "Loops run: rows x loops of RECURRENT batches (prompt tokens too).")
        preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        pc_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        pc_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (their "
                          "prefill, every loop, skipped).")
        reads = counter("kv_transfer_reads", "Decode side: KV READs done (one per handoff).")
        read_fail = counter("kv_transfer_failures", "Decode side: KV READs that failed or timed out.")
        read_bytes = counter("kv_transfer_bytes", "Decode side: bytes of KV read.")
        read_s = counter("kv_transfer_seconds", "Decode side: seconds spent in KV READs.")
        leases = counter("kv_leases_expired", "Prefill side: handoffs freed because their reader "
                         "stopped renewing the lease.")
        for worker, s in sorted(stats.items()):
            lab = [worker, s.role]
            healthy.add_metric(lab, float(s.healthy))
            if (e := s.engine) is None:  # it did not answer
                continue
            running.add_metric(lab, e.scheduler.num_running)
            waiting.add_metric(lab, e.scheduler.num_waiting)
            receiving.add_metric(lab, e.scheduler.num_receiving)
            transferring.add_metric(lab, e.scheduler.num_transferring)
            for pool, u in e.pools().items():
                if u.total:
                    usage.add_metric(lab + [pool], u.used / u.total)
                    used.add_metric(lab + [pool], u.used)
            for plane, n in enumerate(e.planes):
                plane_used.add_metric(lab + ["looped", str(plane)], n)
                if e.looped.total:
                    plane_usage.add_metric(lab + ["looped", str(plane)], n / e.looped.total)
            loops.add_metric(lab, e.counters.loops_run)
            preemptions.add_metric(lab, e.counters.preemptions)
            pc_queries.add_metric(lab, e.prefix_cache.queries)
            pc_hits.add_metric(lab, e.prefix_cache.hits)
            if (d := s.decode) is not None:
                reads.add_metric(lab, d.kv_reads.count)
                read_fail.add_metric(lab, d.kv_reads.failed)
                read_bytes.add_metric(lab, d.kv_reads.bytes)
                read_s.add_metric(lab, d.kv_reads.seconds)
                h = d.handoff_latency
                buckets = [(repr(float(le)), n) for le, n in zip(h.le, h.counts)]
                handoff.add_metric(lab, buckets + [("+Inf", h.count)], h.sum)
            if s.prefill is not None:
                leases.add_metric(lab, s.prefill.leases_expired)
        yield from (healthy, running, waiting, receiving, transferring, usage, used, plane_used,
                    plane_usage, loops, preemptions, pc_queries, pc_hits, reads, read_fail,
                    read_bytes, read_s, handoff, leases)
