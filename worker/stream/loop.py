"""The run loop: take a window from the reader, run its passes, hand each pass's results to the
writer (results + acks in one atomic step per pass), log one line per pass and per window;
stop warm or cold. Four threads: this one (passes), the reader (reads + tokenizes ahead), the
writer (writes behind), the keeper (heartbeat, refresh of the entries held).

Write failures (Redis gone) are retried with capped backoff. Every write (the settle script,
see sink.py) writes and acks only the entries still pending on this consumer: if a lost reply
hid a commit, nothing is written twice; if another worker reclaimed them meanwhile, that
worker owns them now. A lost consumer group (NOGROUP) is handed to the GroupGuard, which
recreates it; the windows read from the lost group are dropped.
"""

from __future__ import annotations

import threading
import time

from worker.logs import get_logger, mask_url
from worker.observability import prometheus  # no-ops unless TRIAGE_METRICS_PORT is set
from worker.stream.classify import PassResult, run_passes
from worker.stream.connection import Backoff, connect, is_transient
from worker.stream.group import GroupGuard, is_nogroup
from worker.stream.health import Heartbeat, Keeper, Status
from worker.stream.metrics import Summary, WindowMetrics, pass_line
from worker.stream.reader import DRAINED, END, Reader
from worker.stream.shutdown import Shutdown
from worker.stream.sink import Outcome, PartialWriteError, ResultSink
from worker.stream.source import StreamSource
from worker.stream.window import Window, pass_outcome, rejections
from worker.stream.writer import PassWrite, WindowJob, Writer, WriterFailed

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_REDIS = 0, 1, 2, 3


def run_worker(settings, *, drain: bool = False) -> int:
    """Run until a signal (or, with ``drain``, until the stream is empty); the exit code.

    Redis first, the model second: a wrong URL or a Redis that is down shows in the first
    second, not after the model has loaded (seconds to minutes)."""
    log = get_logger("triage.worker").bind(consumer=settings.consumer)
    shutdown = Shutdown(log)
    shutdown.install()
    client = connect(settings.redis_url)
    source = StreamSource(client, settings.input_stream, settings.group, settings.consumer)
    ready = _setup(source, settings, shutdown, log, give_up_s=settings.drain_redis_timeout_s if drain else None)
    if ready != "ok":
        if ready == "stopped":
            log.info("worker_stopped", reason=shutdown.reason or "stopped", windows=0, items=0, dead_lettered=0)
            return EXIT_OK
        return EXIT_REDIS if ready == "unreachable" else EXIT_CONFIG

    status = Status(on_phase=prometheus.current().set_phase)
    heartbeat = Heartbeat(
        client,
        settings.heartbeat_key_prefix,
        settings.consumer,
        settings.heartbeat_ttl_s,
        {"stream": settings.input_stream, "group": settings.group, "model": settings.model},
    )
    keeper = Keeper(heartbeat, status, refresh=None, refresh_interval_s=settings.claim_idle_ms / 3000.0, log=log)
    keeper.start()  # phase "starting" while the model loads
    try:
        clf = _load_model(settings, log)
    except BaseException:
        keeper.stop()
        _quietly(heartbeat.clear)
        raise
    heartbeat.info["model"] = clf.model_name
    loop = _Loop(settings, clf, client, source, shutdown, log, drain, status=status, heartbeat=heartbeat, keeper=keeper)
    return loop.run()


def _load_model(settings, log):
    from worker.assemble import build_classifier
    from worker.logs import route_transformers_logs

    route_transformers_logs()
    t0 = time.perf_counter()
    clf = build_classifier(settings)
    clf.classify(clf.prepare_valid(["warm-up ticket: the first real batch should not pay for lazy init"]))
    log.info(
        "model_loaded",
        model=clf.model_name,
        device=str(clf.device),
        dtype=clf.dtype_name,
        labels=list(clf.labels),
        prefix_tokens=clf.prefix_length,
        load_ms=round((time.perf_counter() - t0) * 1000),
        torch_threads=_torch_threads(),
    )
    prometheus.current().set_model(
        model=clf.model_name, device=str(clf.device), dtype=clf.dtype_name, consumer=settings.consumer
    )
    return clf


def _torch_threads() -> int:
    import torch  # already loaded with the model

    return torch.get_num_threads()


def _setup(source: StreamSource, settings, shutdown: Shutdown, log, *, give_up_s: float | None) -> str:
    """Create the group (waiting for Redis if needed) and refuse keys of the wrong type.

    "ok", "stopped" (a signal while waiting), "config" (wrong key type, no permission) or
    "unreachable" (``give_up_s`` passed without an answer: --drain must not hang forever)."""
    backoff = Backoff(settings.reconnect_max_s)
    t0 = time.monotonic()
    while not shutdown.stop.is_set():
        try:
            created = source.ensure_group()
            for name in (settings.input_stream, settings.results_stream, settings.dead_letter_stream):
                kind = source.key_type(name)
                if kind not in ("none", "stream"):
                    log.error(
                        "wrong_key_type",
                        key=name,
                        type=kind,
                        expected="stream",
                        fix="rename the key or point TRIAGE_*_STREAM elsewhere",
                    )
                    return "config"
            if backoff.reset():
                log.info("redis_reconnected", op="setup")
            if created is not None:
                log.info("group_created", stream=settings.input_stream, group=settings.group, start_id=created)
            return "ok"
        except Exception as e:  # noqa: BLE001
            if not is_transient(e):
                log.error("setup_failed", error=f"{type(e).__name__}: {e}")
                return "config"
            waited_s = time.monotonic() - t0
            if backoff.attempt == 0:
                give_up = (
                    f"; --drain gives up after {give_up_s:g} s (TRIAGE_DRAIN_REDIS_TIMEOUT_S)" if give_up_s else ""
                )
                log.warning(
                    "waiting_for_redis",
                    redis_url=mask_url(settings.redis_url),
                    error=f"{type(e).__name__}: {e}",
                    note="the model is loaded once Redis answers" + give_up,
                )
            if give_up_s is not None and waited_s >= give_up_s:
                log.error(
                    "redis_unreachable",
                    redis_url=mask_url(settings.redis_url),
                    waited_s=round(waited_s, 1),
                    error=f"{type(e).__name__}: {e}",
                    action="giving up (exit 3): check TRIAGE_REDIS_URL and that Redis is running",
                )
                return "unreachable"
            delay = backoff.failed(shutdown.stop)
            log.warning(
                "redis_unavailable",
                op="setup",
                error=f"{type(e).__name__}: {e}",
                attempt=backoff.attempt,
                retried_after_s=round(delay, 2),
            )
    return "stopped"


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


class _Loop:
    """The main thread: take a window from the reader, run its passes, write, log.

    Hooks for metrics exporters: ``_on_pass`` (after each forward call) and ``_on_window`` (after a
    window is written and acked, or dropped)."""

    def __init__(
        self,
        settings,
        clf,
        client,
        source: StreamSource,
        shutdown: Shutdown,
        log,
        drain: bool,
        *,
        status: Status,
        heartbeat: Heartbeat,
        keeper: Keeper,
    ):
        self.s = settings
        self.clf = clf
        self.source = source
        self.shutdown = shutdown
        self.log = log
        self.drain = drain
        self.guard = GroupGuard(source, log)
        self.sink = ResultSink(
            client,
            input_stream=settings.input_stream,
            group=settings.group,
            results_stream=settings.results_stream,
            dead_letter_stream=settings.dead_letter_stream,
            result_key_prefix=settings.result_key_prefix,
            result_ttl_s=settings.result_ttl_s,
            results_maxlen=settings.results_maxlen,
            dead_letter_maxlen=settings.dead_letter_maxlen,
            consumer=settings.consumer,
            trim_input=settings.input_trim,
        )
        self.heartbeat = heartbeat
        self.status = status
        self.keeper = keeper
        self.summary = Summary(settings.log_summary_s, time.monotonic())
        self._summary_lock = threading.Lock()
        self.reader = Reader(
            source,
            clf.prepare,
            guard=self.guard,
            max_items=settings.window_max_items,
            max_wait_ms=settings.max_wait_ms,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            max_text_bytes=settings.max_text_bytes,
            reconnect_max_s=settings.reconnect_max_s,
            stop=shutdown.stop,
            log=log,
            drain=drain,
            prefetch=settings.prefetch,
            on_reconnect=self._count_reconnect,
        )
        self.writer = Writer(
            self._commit, on_written=self._on_written, on_window_done=self._on_window_done, max_queued=2
        )
        self.windows = 0

    def _count_reconnect(self) -> None:
        with self._summary_lock:
            self.summary.reconnects += 1
        prometheus.current().reconnected()

    def _refresh(self) -> None:
        """Keeper thread: reset the idle time of every entry this process holds (still pending on it)."""
        epoch = self.guard.epoch
        try:
            self.source.refresh(self.reader.held())
        except Exception as e:  # noqa: BLE001
            if not is_nogroup(e):
                raise
            self.guard.recover(epoch, op="refresh", error=e)

    def run(self) -> int:
        self.keeper.refresh = self._refresh  # the keeper now also keeps this process's in-flight entries fresh
        self.reader.start()
        self.writer.start()
        self.log.info(
            "worker_ready",
            heartbeat_key=self.heartbeat.key,
            results_stream=self.s.results_stream,
            dead_letter_stream=self.s.dead_letter_stream,
        )
        code, why = EXIT_OK, "stopped"
        while True:
            if self.status.phase != "idle":
                self.status.set_phase("reading")
            item = self.reader.next_window(timeout_s=0.5)
            if item is None:
                self.status.set_phase("idle")
            elif isinstance(item, Window):
                try:
                    self._process(item)
                except WriterFailed:
                    pass  # reported below
            if self.writer.failed is not None:
                code, why = EXIT_FAILED, self._writer_failed(self.writer.failed)
                break
            if item == END:
                why = self.shutdown.reason or "stopped"
                break
            elif item == DRAINED:
                why = "drained"
                break
            elif isinstance(item, BaseException):
                code, why = EXIT_FAILED, f"reader crashed: {type(item).__name__}: {item}"
                break
            self._maybe_summary()
        if self.writer.failed is None:
            self.status.set_phase("writing")
            self.writer.close()  # everything handed over is written and acked before the exit
            if self.writer.failed is not None:
                code, why = EXIT_FAILED, self._writer_failed(self.writer.failed)
        self._finish(why)
        return code

    def _writer_failed(self, e: BaseException) -> str:
        if isinstance(e, PartialWriteError):
            self.log.error(
                "wrong_key_type",
                error=str(e),
                action="stopping: nothing of that write was written; fix the key type, then restart",
            )
            return "a results or dead-letter key holds another type"
        self.log.error("writer_crashed", error=f"{type(e).__name__}: {e}")
        return f"writer crashed: {type(e).__name__}: {e}"

    # ----------------------------------------------------------------- window
    def _process(self, w: Window) -> None:
        """Run the window's passes; each pass's results go to the writer at once (the window's dead letters
        with the first), so the write of pass k overlaps the forward of pass k+1."""
        if w.epoch != self.guard.epoch:
            self._drop(w)
            return
        self.windows += 1
        job = WindowJob(
            w,
            WindowMetrics(
                window=self.windows,
                source=w.source,
                read_ms=w.read_ms,
                tokenize_ms=w.tokenize_ms,
                backlog=w.backlog,
                pending=w.pending,
            ),
        )
        first = rejections(w, worker=self.s.consumer, excerpt_bytes=self.s.dead_letter_excerpt_bytes)
        plan = self.clf.plan(w.prepared) if w.prepared else []
        if not plan:
            self._put(PassWrite(job, first, last=True))
            return
        passes = run_passes(self.clf.classify_passes, plan, w.prepared)
        for k in range(len(plan)):
            if job.dropped or w.epoch != self.guard.epoch:  # the group was lost meanwhile: stop spending compute
                job.dropped = True
                self._put(PassWrite(job, last=True))
                return
            self.status.pass_started()
            try:
                res = next(passes)
            finally:
                self.status.pass_finished()
            job.metrics.stats.items += res.stats.items
            job.metrics.stats.merge(res.stats)
            job.metrics.split_retries += res.split_retries
            self._on_pass(job.metrics, k, res)
            out, _ = pass_outcome(
                w,
                res.indices,
                res.predictions,
                model=self.clf.model_name,
                worker=self.s.consumer,
                excerpt_bytes=self.s.dead_letter_excerpt_bytes,
            )
            if k == 0:
                out = Outcome(out.results, first.dead_letters + out.dead_letters, first.ack_ids + out.ack_ids)
            self._put(PassWrite(job, out, last=k == len(plan) - 1))

    def _put(self, item: PassWrite) -> None:
        self.writer.put(item, on_wait=lambda: self.status.set_phase("writing"))

    def _on_pass(self, m: WindowMetrics, index: int, res: PassResult) -> None:
        """After each forward call (main thread)."""
        if res.split_retries:
            self.log.warning(
                "pass_failed_split",
                window=m.window,
                items=len(res.indices),
                failed_alone=sum(isinstance(p, Exception) for p in res.predictions),
            )
        self.log.info("pass", **pass_line(m.window, index, res.stats, split_retries=res.split_retries))
        prometheus.current().on_pass(res.stats)

    def _on_written(self, job: WindowJob, written: Outcome) -> None:
        """After each write (writer thread): count what was written and acked."""
        m = job.metrics
        m.items += len(written.results)
        m.dead_lettered += len(written.dead_letters)
        m.latencies_ms += [float(r["latency_ms"]) for r in written.results if "latency_ms" in r]
        for d in written.dead_letters:
            self.log.warning(
                "dead_lettered",
                stream_id=d["stream_id"],
                id=d.get("id"),
                reason=d["reason"],
                deliveries=int(d["deliveries"]),
            )
        prometheus.current().on_written(written)

    def _on_window_done(self, job: WindowJob) -> None:
        """After a window's last write (writer thread): count it, log its line, free its slot in the reader."""
        if job.dropped:
            self._drop(job.window)
            return
        m = job.metrics
        self.status.add(batches=1, items=m.items, dead_lettered=m.dead_lettered)
        with self._summary_lock:
            self.summary.add(m)
        self.log.info("window", **m.line())
        prometheus.current().on_window(m)
        self.reader.settled(job.window)

    def _drop(self, w: Window) -> None:
        """A window read from a consumer group that is gone: its entries cannot be acked, so nothing more is written."""
        self.log.warning(
            "window_dropped",
            entries=len(w.ids),
            source=w.source,
            reason="consumer group lost",
            note="entries still in the stream after the recovery point are delivered again",
        )
        self.reader.settled(w)

    def _maybe_summary(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._summary_lock:
            line = self.summary.take(now) if force or self.summary.due(now) else None
        if line is not None:
            self.log.info("summary", **line)

    def _commit(self, outcome: Outcome, w: Window) -> Outcome | None:
        """Write + ack what is still ours; on Redis errors retry (forever, capped backoff).

        None: the consumer group was lost (and recreated): the window must be dropped."""
        backoff = Backoff(self.s.reconnect_max_s)
        while True:
            try:
                written = self.sink.write(outcome)
                if written.not_ours:
                    self.log.warning(
                        "entries_not_ours_anymore",
                        count=len(written.not_ours),
                        retry=backoff.attempt,
                        note="acked by an earlier attempt, or reclaimed by another worker: not written again",
                    )
                if backoff.reset():
                    self.log.info("redis_reconnected", op="write")
                return written.outcome
            except PartialWriteError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the window, keep trying: never drop, never ack blindly
                if is_nogroup(e):
                    try:
                        self.guard.recover(w.epoch, op="write", error=e)
                        return None
                    except Exception as again:  # noqa: BLE001 - Redis down while recreating: retry below
                        e = again
                self._count_reconnect()
                delay = backoff.failed()
                self.log.warning(
                    "redis_unavailable" if is_transient(e) else "write_failed",
                    op="write",
                    error=f"{type(e).__name__}: {e}",
                    attempt=backoff.attempt,
                    retried_after_s=round(delay, 2),
                    entries=len(w.ids),
                )

    # -------------------------------------------------------------- shutdown
    def _finish(self, why: str) -> None:
        self.shutdown.stop.set()
        self._maybe_summary(force=True)
        self.keeper.stop()
        try:
            self.heartbeat.clear()
            if self.source.own_pending_count() == 0:
                self.source.delete_consumer()  # unique per process: do not leave a trail of dead names in XINFO
        except Exception as e:  # noqa: BLE001
            self.log.warning("cleanup_failed", error=str(e))
        totals = self.status.snapshot()
        self.log.info(
            "worker_stopped",
            reason=why,
            windows=self.windows,
            items=totals["items"],
            dead_lettered=totals["dead_lettered"],
        )
