"""Prometheus metrics of one worker process, served over HTTP on ``TRIAGE_METRICS_PORT`` (0 = off).

Names follow text-embeddings-inference (TEI) where it has a counterpart, so TEI
dashboards translate: ``te_request_success`` -> ``triage_request_success_total``,
``te_batch_next_size`` -> ``triage_batch_next_size``, ``te_queue_size`` ->
``triage_queue_size``, plus the Prometheus conventions (``_total`` counters,
``_seconds`` durations). A TEI "batch" is one forward call, what this project calls
a *pass*; a *window* (one drain of the stream) has no TEI counterpart and is named
``triage_window_*``. docs/worker.md lists every metric with PromQL.

The loop only calls a few hooks (``set_phase``, ``observe_batch``, ``reconnected``,
``set_model``) on ``current()``; with metrics off that is the no-op ``Metrics`` and
``prometheus_client`` is never imported. Neither torch nor Redis is imported here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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

    def set_queue(self, backlog: int | None, pending: int | None) -> None:
        pass

    def observe_window(self, **_: Any) -> None:
        pass

    def observe_pass(self, *, size: int, padded_tokens: int | None = None, infer_s: float | None = None) -> None:
        pass

    def observe_results(
        self,
        *,
        n_ok: int,
        latencies_ms: Sequence[float] = (),
        input_tokens: Sequence[int] = (),
        dead_reasons: Sequence[str] = (),
    ) -> None:
        pass

    # adapters for the stream loop's own objects (PassStats, written Outcome, WindowMetrics)
    def on_pass(self, stats: Any) -> None:
        pass

    def on_written(self, written: Any) -> None:
        pass

    def on_window(self, m: Any) -> None:
        pass


class PrometheusMetrics(Metrics):
    """The registry and every metric object of this process; ``serve()`` exposes them over HTTP."""

    enabled = True

    def __init__(self, registry: Any = None):
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
        r = registry

        # --- tickets (TEI: te_request_*) -------------------------------------------------
        self.request_count = Counter(
            "triage_request_count", "Input entries settled: classified or dead-lettered.", registry=r
        )
        self.request_success = Counter(
            "triage_request_success", "Tickets classified (a result was written).", registry=r
        )
        self.request_failure = Counter(
            "triage_request_failure", "Entries dead-lettered, by reason class.", ["reason"], registry=r
        )
        for c in REASON_CLASSES:
            self.request_failure.labels(c)  # every class exists from the start, so rate() and alerts see 0
        self.request_duration = Histogram(
            "triage_request_duration_seconds",
            "Enqueue (input entry id) to result written, per classified ticket.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.request_input_tokens = Histogram(
            "triage_request_input_tokens",
            "Text tokens the model read, per ticket.",
            buckets=INPUT_TOKEN_BUCKETS,
            registry=r,
        )
        # --- passes = forward calls (TEI: te_batch_*) ------------------------------------
        self.batch_next_size = Histogram(
            "triage_batch_next_size", "Tickets per forward pass (length bucket).", buckets=SIZE_BUCKETS, registry=r
        )
        self.batch_next_tokens = Histogram(
            "triage_batch_next_tokens",
            "Computed (padded) tokens per forward pass.",
            buckets=PASS_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_inference_duration = Histogram(
            "triage_batch_inference_duration_seconds",
            "Model time of one forward pass.",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        # --- windows = one drain of the stream --------------------------------------------
        self.window_size = Histogram(
            "triage_window_size",
            "Entries settled per window (one drain of the stream).",
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.window_entries = Counter(
            "triage_window_entries",
            "Entries settled, by how they were read (new, pending = own re-read, claimed = XAUTOCLAIM).",
            ["source"],
            registry=r,
        )
        for s in SOURCES:
            self.window_entries.labels(s)
        stage = "Time per window spent "
        self.window_read = Histogram(
            "triage_window_read_duration_seconds",
            stage + "reading from Redis (includes waiting up to TRIAGE_MAX_WAIT_MS to fill).",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.window_tokenize = Histogram(
            "triage_window_tokenization_duration_seconds",
            stage + "parsing and tokenizing.",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.window_infer = Histogram(
            "triage_window_inference_duration_seconds",
            stage + "in the model (all its passes).",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.window_write = Histogram(
            "triage_window_write_duration_seconds",
            stage + "building records and in the MULTI/EXEC write + ack.",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.real_tokens = Counter(
            "triage_real_tokens", "Ticket tokens the model had to read (no padding).", registry=r
        )
        self.padded_tokens = Counter(
            "triage_padded_tokens", "Tokens computed, padding included (>= real tokens).", registry=r
        )
        self.prefix_tokens_reused = Counter(
            "triage_prefix_tokens_reused",
            "Prompt-prefix tokens served from the KV cache instead of recomputed.",
            registry=r,
        )
        self.split_retries = Counter(
            "triage_split_retries", "Tickets re-run alone after their window failed.", registry=r
        )
        self.last_window = Gauge(
            "triage_last_window_timestamp_seconds", "Unix time the last window was written.", registry=r
        )
        # --- queue (TEI: te_queue_size), worker --------------------------------------------
        self.queue_size = Gauge(
            "triage_queue_size",
            "Entries not yet delivered to the group (XINFO GROUPS lag), "
            "as seen by this worker at its last read; the same for every worker of the group.",
            registry=r,
        )
        self.queue_pending = Gauge(
            "triage_queue_pending",
            "Entries delivered and not yet acked, whole group, as seen by this worker at its last read.",
            registry=r,
        )
        self.reconnects = Counter(
            "triage_redis_reconnects", "Redis operations retried after a connection error.", registry=r
        )
        self.phase = Gauge(
            "triage_worker_phase", "1 for the phase the main loop is in, 0 for the others.", ["phase"], registry=r
        )
        self.phase_started = Gauge(
            "triage_worker_phase_started_timestamp_seconds",
            "Unix time the current phase began (alert on time() - this while inferring).",
            registry=r,
        )
        self.model_info = Info("triage_model", "The model this worker serves and where it runs.", registry=r)
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

    def set_queue(self, backlog: int | None, pending: int | None) -> None:
        if backlog is not None:
            self.queue_size.set(backlog)
        if pending is not None:
            self.queue_pending.set(pending)

    def observe_window(
        self,
        *,
        size: int,
        source: str = "new",
        read_s: float = 0.0,
        tokenize_s: float = 0.0,
        infer_s: float = 0.0,
        write_s: float = 0.0,
        real_tokens: int = 0,
        padded_tokens: int = 0,
        prefix_tokens_reused: int = 0,
        split_retries: int = 0,
    ) -> None:
        """One written window: its size and where its time went."""
        self.window_size.observe(size)
        self.window_entries.labels(source).inc(size)
        self.window_read.observe(read_s)
        self.window_tokenize.observe(tokenize_s)
        self.window_infer.observe(infer_s)
        self.window_write.observe(write_s)
        self.real_tokens.inc(real_tokens)
        self.padded_tokens.inc(padded_tokens)
        self.prefix_tokens_reused.inc(prefix_tokens_reused)
        self.split_retries.inc(split_retries)
        self.last_window.set(time.time())

    def observe_pass(self, *, size: int, padded_tokens: int | None = None, infer_s: float | None = None) -> None:
        """One forward pass; tokens and time only where the caller measured them per pass."""
        self.batch_next_size.observe(size)
        if padded_tokens is not None:
            self.batch_next_tokens.observe(padded_tokens)
        if infer_s is not None:
            self.batch_inference_duration.observe(infer_s)

    def observe_results(
        self,
        *,
        n_ok: int,
        latencies_ms: Sequence[float] = (),
        input_tokens: Sequence[int] = (),
        dead_reasons: Sequence[str] = (),
    ) -> None:
        """Tickets written: ``n_ok`` results (their latencies and token counts) and dead letters (their reasons)."""
        self.request_count.inc(n_ok + len(dead_reasons))
        self.request_success.inc(n_ok)
        for reason in dead_reasons:
            self.request_failure.labels(reason_class(reason)).inc()
        for ms in latencies_ms:
            self.request_duration.observe(ms / 1000.0)
        for n in input_tokens:
            self.request_input_tokens.observe(n)

    def on_pass(self, stats: Any) -> None:
        """After each forward call: the engine's ``PassStats``."""
        self.observe_pass(size=stats.items, padded_tokens=stats.padded_tokens, infer_s=stats.infer_ms / 1000.0)

    def on_written(self, written: Any) -> None:
        """After each write: the ``Outcome`` actually written (entries another worker took over are not in it)."""
        self.observe_results(
            n_ok=len(written.results),
            latencies_ms=[float(r["latency_ms"]) for r in written.results if r.get("latency_ms")],
            input_tokens=[int(r["tokens"]) for r in written.results if r.get("tokens")],
            dead_reasons=[d.get("reason", "") for d in written.dead_letters],
        )

    def on_window(self, m: Any) -> None:
        """After a window's last write: its ``WindowMetrics`` (the passes added up in ``m.stats``)."""
        st = m.stats
        self.observe_window(
            size=m.items + m.dead_lettered,
            source=m.source,
            read_s=m.read_ms / 1000.0,
            tokenize_s=m.tokenize_ms / 1000.0,
            infer_s=st.infer_ms / 1000.0,
            write_s=m.write_ms / 1000.0,
            real_tokens=st.real_tokens,
            padded_tokens=st.padded_tokens,
            prefix_tokens_reused=st.prefix_tokens_reused,
            split_retries=m.split_retries,
        )
        self.set_queue(m.backlog, m.pending)


_current: Metrics = Metrics()


def current() -> Metrics:
    """This process's metrics (the no-op ``Metrics`` until ``start`` served some)."""
    return _current


def start(host: str, port: int) -> Metrics:
    """Serve metrics on ``host:port`` and make them ``current()``; port 0 leaves metrics off.

    Raises ``OSError`` when the port cannot be bound: the caller reports it as a configuration error."""
    global _current
    if not port:
        return _current
    metrics = PrometheusMetrics()
    metrics.serve(host, port)
    _current = metrics
    return metrics
