"""Prometheus metrics of one worker process, served over HTTP on ``TRIAGE_METRICS_PORT`` (0 = off).

Names follow text-embeddings-inference (TEI) where it has a counterpart, so TEI
dashboards translate: ``te_request_success`` -> ``triage_request_success_total``,
``te_batch_next_size`` -> ``triage_batch_next_size``, ``te_queue_size`` ->
``triage_queue_size``, plus the Prometheus conventions (``_total`` counters,
``_seconds`` durations). A TEI "batch" is one forward call, what this project calls
a *pass*; a *window* (one drain of the stream) has no TEI counterpart and is named
``triage_window_*``. docs/worker.md lists every metric with PromQL.

The loop only calls a few hooks (``set_model``, ``set_phase``, ``reconnected``, ``on_passes``,
``on_written``, ``on_window``, ``on_graphs``) on ``current()``, the RQ batch worker some of them and
``on_settled`` (no windows, no stream); with metrics off that is the no-op ``Metrics`` and
``prometheus_client`` is never imported. Neither torch nor Redis is imported here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from worker.observability.reasons import REASON_CLASSES, reason_class

CONVENTIONAL_PORT = 9108  # documented choice for TRIAGE_METRICS_PORT (the default stays 0 = off)

# Stage durations on a busy CPU reach minutes per window; on a GPU, milliseconds per pass.
DURATION_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    600.0,
)
LATENCY_BUCKETS_S = DURATION_BUCKETS_S + (1800.0, 3600.0)  # enqueue -> result includes time spent in the backlog
SIZE_BUCKETS = tuple(float(2**i) for i in range(14))  # 1 .. 8192 tickets (windows of thousands on a GPU)
PASS_TOKEN_BUCKETS = tuple(float(2**i) for i in range(21))  # 1 .. ~1M padded tokens per pass (TEI's buckets)
INPUT_TOKEN_BUCKETS = tuple(float(2**i) for i in range(14))  # 1 .. 8192 tokens per ticket
PHASES = ("starting", "reading", "inferring", "writing", "idle", "stopping")
SOURCES = ("new", "pending", "claimed")


class Metrics:
    """Metrics off: every hook is a no-op (the loop calls these unconditionally)."""

    enabled = False

    def set_model(self, *, model: str, device: str, dtype: str, consumer: str, version: str | None = None) -> None:
        pass

    def set_phase(self, phase: str) -> None:
        pass

    def reconnected(self) -> None:
        pass

    # the stream loop's own objects (PassStats, written Outcome, WindowMetrics)
    def on_passes(self, run: Any) -> None:
        pass

    def on_written(self, written: Any) -> None:
        pass

    def on_settled(self, results: Sequence[Mapping[str, Any]], failure_reasons: Sequence[str]) -> None:
        pass

    def on_run(self, stats: Any, split_retries: int) -> None:
        pass

    def on_window(self, m: Any) -> None:
        pass

    def on_queue(self, backlog: int | None, pending: int | None) -> None:
        pass

    def on_graphs(self, stats: dict | None) -> None:
        pass


class PrometheusMetrics(Metrics):
    """The registry and every metric object of this process; ``serve()`` exposes them over HTTP."""

    enabled = True

    def __init__(self, registry: Any = None, *, windows: bool = True):
        """``windows=False``: no window and queue series (the RQ batch worker): a series that never moves would read
        as a stalled worker to ``time() - triage_last_window_timestamp_seconds``."""
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            Info,
            PlatformCollector,
            ProcessCollector,
            disable_created_metrics,
        )

        disable_created_metrics()  # no *_created series: half the lines, nothing a dashboard uses
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
            PlatformCollector(registry=registry)
        self.registry = registry
        counter = partial(Counter, registry=registry)
        gauge = partial(Gauge, registry=registry)
        histogram = partial(Histogram, registry=registry)

        def stage(name: str, spent: str) -> Any:  # where a window's time went
            return histogram(name, "Time per window spent " + spent, buckets=DURATION_BUCKETS_S)

        # --- tickets (TEI: te_request_*) -------------------------------------------------
        self.request_count = counter("triage_request_count", "Input entries settled: classified or dead-lettered.")
        self.request_success = counter("triage_request_success", "Tickets classified (a result was written).")
        self.request_failure = counter("triage_request_failure", "Entries dead-lettered, by reason class.", ["reason"])
        for c in REASON_CLASSES:
            self.request_failure.labels(c)  # every class exists from the start, so rate() and alerts see 0
        self.request_duration = histogram(
            "triage_request_duration_seconds",
            "Enqueue (input entry id) to result written, per classified ticket.",
            buckets=LATENCY_BUCKETS_S,
        )
        self.request_input_tokens = histogram(
            "triage_request_input_tokens", "Text tokens the model read, per ticket.", buckets=INPUT_TOKEN_BUCKETS
        )
        # --- passes = forward calls (TEI: te_batch_*) ------------------------------------
        self.batch_next_size = histogram(
            "triage_batch_next_size", "Tickets per forward pass (length bucket).", buckets=SIZE_BUCKETS
        )
        self.batch_next_tokens = histogram(
            "triage_batch_next_tokens", "Computed (padded) tokens per forward pass.", buckets=PASS_TOKEN_BUCKETS
        )
        self.batch_inference_duration = histogram(
            "triage_batch_inference_duration_seconds", "Model time of one forward pass.", buckets=DURATION_BUCKETS_S
        )
        self.real_tokens = counter("triage_real_tokens", "Ticket tokens the model had to read (no padding).")
        self.padded_tokens = counter("triage_padded_tokens", "Tokens computed, padding included (>= real tokens).")
        self.prefix_tokens_reused = counter(
            "triage_prefix_tokens_reused", "Prompt-prefix tokens served from the KV cache instead of recomputed."
        )
        self.split_retries = counter("triage_split_retries", "Tickets re-run alone after their pass failed.")
        self.windows = windows
        if windows:  # the stream worker's: windows and the group's queue (the RQ batch worker has neither)
            # --- windows = one drain of the stream --------------------------------------------
            self.window_size = histogram(
                "triage_window_size", "Entries settled per window (one drain of the stream).", buckets=SIZE_BUCKETS
            )
            self.window_entries = counter(
                "triage_window_entries",
                "Entries settled, by how they were read (new, pending = own re-read, claimed = XAUTOCLAIM).",
                ["source"],
            )
            for s in SOURCES:
                self.window_entries.labels(s)
            self.window_read = stage(
                "triage_window_read_duration_seconds",
                "reading from Redis (includes waiting up to TRIAGE_MAX_WAIT_MS to fill).",
            )
            self.window_tokenize = stage("triage_window_tokenization_duration_seconds", "parsing and tokenizing.")
            self.window_infer = stage("triage_window_inference_duration_seconds", "in the model (all its passes).")
            self.window_write = stage(
                "triage_window_write_duration_seconds", "building records and in the settle script (results, acks)."
            )
            self.windows_first_pass_early = counter(
                "triage_windows_first_pass_early",
                "Windows whose first pass was queued while the window before finished (lookahead across windows).",
            )
            self.last_window = gauge("triage_last_window_timestamp_seconds", "Unix time the last window was written.")
            # --- queue (TEI: te_queue_size), worker --------------------------------------------
            self.queue_size = gauge(
                "triage_queue_size",
                "Entries not yet delivered to the group (XINFO GROUPS lag), "
                "as seen by this worker at its last window or heartbeat; the same for every worker of the group.",
            )
            self.queue_pending = gauge(
                "triage_queue_pending",
                "Entries delivered and not yet acked, whole group, at this worker's last window or heartbeat.",
            )
        self.reconnects = counter(
            "triage_redis_reconnects",
            "Waits for Redis that ended: an operation went through after failed tries (one per redis_reconnected).",
        )
        self.phase = gauge("triage_worker_phase", "1 for the phase the main loop is in, 0 for the others.", ["phase"])
        self.phase_started = gauge(
            "triage_worker_phase_started_timestamp_seconds",
            "Unix time the current phase began (alert on time() - this while inferring).",
        )
        self.model_info = Info("triage_model", "The model this worker serves and where it runs.", registry=registry)
        self._graphs: dict | None = None  # CUDA graph series, made on the first totals (none off CUDA)
        self._graph_totals: dict = {}
        self._phase: str | None = None
        self._server = None
        self.set_phase("starting")

    # ------------------------------------------------------------------ serving
    def serve(self, host: str, port: int) -> int:
        """Serve the exposition on http://host:port/metrics in a daemon thread; the bound port.

        Raises ``OSError`` if the port cannot be bound (in use, not allowed)."""
        from prometheus_client import start_http_server

        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -------------------------------------------------------------------- hooks
    def set_model(self, *, model: str, device: str, dtype: str, consumer: str, version: str | None = None) -> None:
        if version is None:
            from worker import __version__ as version
        self.model_info.info(
            {"model": model, "device": device, "dtype": dtype, "version": version, "consumer": consumer}
        )

    def set_phase(self, phase: str) -> None:
        if phase == self._phase:
            return
        for p in PHASES:
            self.phase.labels(p).set(1 if p == phase else 0)
        if phase not in PHASES:  # a phase added elsewhere shows up instead of raising in the loop
            self.phase.labels(phase).set(1)
        self._phase = phase
        self.phase_started.set(time.time())

    def reconnected(self) -> None:
        self.reconnects.inc()

    def on_passes(self, run: Any) -> None:
        """After a planned pass: each forward call it took (``RunStats.pass_stats``: one, or one per ticket after
        the pass failed and its tickets were re-run alone)."""
        for p in run.pass_stats:
            self.batch_next_size.observe(p.items)
            self.batch_next_tokens.observe(p.padded_tokens)
            self.batch_inference_duration.observe(p.infer_ms / 1000.0)

    def on_written(self, written: Any) -> None:
        """After each write: the ``Outcome`` actually written (entries another worker took over are not in it)."""
        self.on_settled(written.results, [d.get("reason", "") for d in written.dead_letters])

    def on_settled(self, results: Sequence[Mapping[str, Any]], failure_reasons: Sequence[str]) -> None:
        """Tickets settled: result records (``latency_ms``, ``tokens``) and the reasons of those that failed
        (dead letters here; failed jobs in the RQ batch worker)."""
        self.request_count.inc(len(results) + len(failure_reasons))
        self.request_success.inc(len(results))
        for reason in failure_reasons:
            self.request_failure.labels(reason_class(reason)).inc()
        for r in results:
            if r.get("latency_ms"):
                self.request_duration.observe(float(r["latency_ms"]) / 1000.0)
            if r.get("tokens"):
                self.request_input_tokens.observe(int(r["tokens"]))

    def on_window(self, m: Any) -> None:
        """After a window's last write: its ``WindowMetrics`` (the passes added up in ``m.stats``)."""
        if not self.windows:
            return
        st, size = m.stats, m.items + m.dead_lettered
        self.window_size.observe(size)
        self.window_entries.labels(m.source).inc(size)
        self.window_read.observe(m.read_ms / 1000.0)
        self.window_tokenize.observe(m.tokenize_ms / 1000.0)
        self.window_infer.observe(st.infer_ms / 1000.0)
        self.window_write.observe(m.write_ms / 1000.0)
        self.on_run(st, m.split_retries)
        if m.first_pass_early:
            self.windows_first_pass_early.inc()
        self.last_window.set(time.time())
        self.on_queue(m.backlog, m.pending)

    def on_queue(self, backlog: int | None, pending: int | None) -> None:
        """The group's backlog (XINFO lag) and pending count, as last read (None: not known, left as it was)."""
        if not self.windows:
            return
        if backlog is not None:
            self.queue_size.set(backlog)
        if pending is not None:
            self.queue_pending.set(pending)

    def on_run(self, stats: Any, split_retries: int) -> None:
        """Passes added up (a window's, an RQ batch's ``RunStats``): tokens read, computed and reused; tickets
        re-run alone after their pass failed."""
        self.real_tokens.inc(stats.real_tokens)
        self.padded_tokens.inc(stats.padded_tokens)
        self.prefix_tokens_reused.inc(stats.prefix_tokens_reused)
        self.split_retries.inc(split_retries)

    def on_graphs(self, stats: dict | None) -> None:
        """After each window: the classifier's CUDA graph totals (``GraphRunner.stats``). None (no graphs on this
        device) makes no series; ``triage_cuda_graphs_enabled`` 0 means capture or a replay check failed and every
        pass now runs eagerly, several times slower: worth an alert."""
        if stats is None:
            return
        if self._graphs is None:
            from prometheus_client import Counter, Gauge

            r = self.registry
            self._graphs = {
                "enabled": Gauge(
                    "triage_cuda_graphs_enabled", "1: packed passes replay CUDA graphs; 0: turned off.", registry=r
                ),
                "shapes": Gauge("triage_cuda_graph_shapes", "Pass shapes captured as CUDA graphs.", registry=r),
                "replays": Counter("triage_cuda_graph_replays", "Passes run by a CUDA graph replay.", registry=r),
                "captures": Counter("triage_cuda_graph_captures", "Pass shapes captured (and checked).", registry=r),
                "eager_new_shape": Counter(
                    "triage_cuda_graph_eager_passes", "Passes run eagerly on their shape's first sight.", registry=r
                ),
            }
        g = self._graphs
        g["enabled"].set(1 if stats["enabled"] else 0)
        g["shapes"].set(stats["shapes"])
        for k in ("replays", "captures", "eager_new_shape"):
            g[k].inc(max(0, stats[k] - self._graph_totals.get(k, 0)))
            self._graph_totals[k] = stats[k]


_current: Metrics = Metrics()


def current() -> Metrics:
    """This process's metrics (the no-op ``Metrics`` until ``start`` served some)."""
    return _current


def start(host: str, port: int, *, windows: bool = True) -> Metrics:
    """Serve metrics on ``host:port`` and make them ``current()``; port 0 leaves metrics off.

    Raises ``OSError`` when the port cannot be bound: the caller reports it as a configuration error."""
    global _current
    if not port:
        return _current
    metrics = PrometheusMetrics(windows=windows)
    metrics.serve(host, port)
    _current = metrics
    return metrics


def start_for(settings, log, *, windows: bool = True) -> bool:
    """Serve metrics as the worker's settings say (``TRIAGE_METRICS_PORT``, ``TRIAGE_METRICS_HOST``), before the
    model loads (scrapes see phase "starting"); False, after logging why, if the port is unusable (exit 2)."""
    if not settings.metrics_port:
        return True
    try:
        start(settings.metrics_host, settings.metrics_port, windows=windows)
    except OSError as e:
        log.error(
            "metrics_unavailable",
            host=settings.metrics_host,
            port=settings.metrics_port,
            error=str(e),
            fix="free the port or set another TRIAGE_METRICS_PORT (one per worker process on a host); "
            "0 turns metrics off",
        )
        return False
    log.info("metrics_serving", url=f"http://{settings.metrics_host}:{settings.metrics_port}/metrics")
    return True
