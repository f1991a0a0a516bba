"""The run loop: take a window from the reader, run its passes, hand each pass's results to the
writer (results + acks in one atomic step per pass), log one line per pass and per window;
stop warm or cold. Four threads: this one (passes), the reader (reads, tokenizes and plans ahead), the
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
from functools import partial
from typing import TYPE_CHECKING

from worker.engine.isolation import PassResult, run_passes
from worker.observability import prometheus  # no-ops unless TRIAGE_METRICS_PORT is set
from worker.stream.connection import Backoff, is_transient, reply_parser
from worker.stream.group import GroupGuard, is_nogroup
from worker.stream.metrics import Summary, WindowMetrics, pass_line
from worker.stream.reader import DRAINED, END, Reader
from worker.stream.records import stamp_latency
from worker.stream.sink import Outcome, PartialWriteError, ResultSink, WriteRefused
from worker.stream.sizing import WindowSizer
from worker.stream.startup import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, PERMISSION_FIX, Started, release, start
from worker.stream.window import Window, pass_outcome, rejections
from worker.stream.writer import PassWrite, WindowJob, Writer, WriterFailed

if TYPE_CHECKING:
    from worker.engine.launch import Prelaunched

_NOTHING = object()  # no item taken early
EARLY_POLL_S = 0.002  # how often the wait for the next window asks whether the device is done
READER_JOIN_S = 2.0  # at exit: a read in progress (a 0.5 s block, then the rest of a window) ends by then


def wait_while(get, busy, poll_s: float = EARLY_POLL_S):
    """``get(timeout_s)`` at once, then again every ``poll_s`` while ``busy()``: the first item, or None."""
    item = get(0)
    while item is None and busy():
        item = get(poll_s)
    return item


def run_worker(settings, *, drain: bool = False) -> int:
    """Run until a signal (or, with ``drain``, until the stream is empty); the exit code."""
    started = start(settings, drain=drain)
    if isinstance(started, int):
        return started
    return _Loop(settings, started, drain).run()


class _Loop:
    """The main thread: take a window from the reader, run its passes, write, log.

    Hooks for metrics exporters: ``_on_pass`` (after each forward call), ``_on_written`` (after each write)
    and ``_on_window_done`` (after a window is written and acked, or dropped)."""

    def __init__(self, settings, started: Started, drain: bool):
        self.s = settings
        self.clf = started.clf
        self.source = started.source
        self.shutdown = started.shutdown
        self.log = started.log
        self.drain = drain
        self.guard = GroupGuard(self.source, self.log)
        self.sink = ResultSink.for_worker(started.client, settings)
        self.heartbeat = started.heartbeat
        self.status = started.status
        self.keeper = started.keeper
        self.summary = Summary(settings.log_summary_s, time.monotonic())
        self.sizer = WindowSizer.for_worker(settings, started.clf)
        self._summary_lock = threading.Lock()
        self.reader = Reader(
            self.source,
            self.clf.prepare,
            plan=self.clf.plan,
            guard=self.guard,
            sizer=self.sizer,
            max_wait_ms=settings.max_wait_ms,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            max_text_bytes=settings.max_text_bytes,
            reconnect_max_s=settings.reconnect_max_s,
            stop=self.shutdown.stop,
            log=self.log,
            drain=drain,
            prefetch=settings.prefetch,
            on_reconnect=self._count_reconnect,
            orphans=ResultSink.for_worker(self.source.client, settings, owned=False),
            on_orphans_dead_lettered=self._count_orphans,
        )
        self.sink.held_floor = self.reader.in_flight.lowest  # the trim keeps what this process holds
        self.writer = Writer(
            self._commit, on_written=self._on_written, on_window_done=self._on_window_done, max_queued=2
        )
        self.windows = 0
        self._taken_early: object = _NOTHING  # what the reader handed over while the last window finished
        self._first_early: tuple[Window, Prelaunched] | None = None  # that window and its first pass, queued

    def _count_reconnect(self) -> None:
        with self._summary_lock:
            self.summary.reconnects += 1
        prometheus.current().reconnected()

    def _count_orphans(self, n: int) -> None:
        """Reader thread: dead letters of claimed entries Redis found deleted. They belong to no window, but the
        summary, the heartbeat's totals and ``worker_stopped`` count every dead letter this worker wrote."""
        self.status.add(dead_lettered=n)
        with self._summary_lock:
            self.summary.dead_lettered += n

    def _refresh(self) -> None:
        """Keeper thread: reset the idle time of every entry this process holds (still pending on it)."""
        epoch = self.guard.epoch
        try:
            self.source.refresh(self.reader.held())
        except Exception as e:  # noqa: BLE001
            if not is_nogroup(e):
                raise
            self.guard.recover(epoch, op="refresh", error=e)

    def _queue_gauges(self) -> None:
        """Keeper thread, every beat: the queue gauges, also while no window comes (an idle worker's would keep
        the last window's figures, read while its own entries were still pending)."""
        state = self.source.group_state()
        if state is not None:
            prometheus.current().on_queue(state.lag, state.pending)

    def run(self) -> int:
        self.keeper.refresh = self._refresh  # the keeper now also keeps this process's in-flight entries fresh
        self.guard.on_recovered(self.keeper.beat_soon)  # a lost group lost the heartbeat key too (FLUSHALL)
        if prometheus.current().enabled:
            self.keeper.on_beat = self._queue_gauges
        self.reader.start()
        self.writer.start()
        self.log.info(
            "worker_ready",
            heartbeat_key=self.heartbeat.key,
            results_stream=self.s.results_stream,
            dead_letter_stream=self.s.dead_letter_stream,
            window_max_items=self.sizer.max_items,
            window_target_s=self.sizer.target_s,
            window_probe_items=self.sizer.probe_items,
            window_ramp_items=self.sizer.ramp_items,
            redis_parser=reply_parser(),
        )
        code, why = EXIT_OK, "stopped"
        while True:
            if self.status.phase != "idle":
                self.status.set_phase("reading")
            item = self._next_item()
            if item is None:
                self.status.set_phase("idle")
            elif isinstance(item, Window):
                try:
                    self._process(item)
                except WriterFailed:
                    pass  # reported below
            if self.writer.failed is not None:
                code, why = self._writer_failed(self.writer.failed)
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
        self.shutdown.stop.set()  # the loop is done: the reader stops; the phase says "stopping" until the exit
        if self.writer.failed is None:
            self.status.set_phase("stopping")
            self.writer.close()  # everything handed over is written and acked before the exit
            if self.writer.failed is not None:
                code, why = self._writer_failed(self.writer.failed)
        return self._finish(code, why)

    def _writer_failed(self, e: BaseException) -> tuple[int, str]:
        """The exit code and reason of a writer that stopped, its event logged."""
        if isinstance(e, PartialWriteError):
            self.log.error(
                "wrong_key_type",
                error=str(e),
                action="stopping: nothing of that write was written; fix the key type, then restart",
            )
            return EXIT_FAILED, "a results or dead-letter key holds another type"
        if isinstance(e, WriteRefused):
            self.log.error(  # the ACL changed while the worker ran (start-up checks the same commands)
                "permission_denied",
                error=str(e),
                action=f"stopping (exit 2): nothing of that write was acknowledged; {PERMISSION_FIX}: the records "
                "written before the refusal are written again then (same stream_id)",
            )
            return EXIT_CONFIG, "Redis refuses the worker a command or key it needs"
        self.log.error("writer_crashed", error=f"{type(e).__name__}: {e}")
        return EXIT_FAILED, f"writer crashed: {type(e).__name__}: {e}"

    # ----------------------------------------------------------------- window
    def _process(self, w: Window) -> None:
        """Run the window's passes; each pass's results go to the writer at once (the window's dead letters
        with the first), so the write of pass k overlaps the forward of pass k+1."""
        early, self._first_early = self._first_early, None
        early = early[1] if early is not None and early[0] is w else None
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
                cap_items=w.cap_items,
            ),
        )
        first = rejections(w, worker=self.s.consumer, excerpt_bytes=self.s.dead_letter_excerpt_bytes)
        plan = w.passes
        if not plan:
            self._put(PassWrite(job, first, last=True))
            return
        job.metrics.first_pass_early = early is not None
        classify = partial(self.clf.classify_passes, first=early)
        passes = run_passes(classify, plan, w.prepared, before_last=self._take_next_early)
        for k in range(len(plan)):
            if job.dropped or w.epoch != self.guard.epoch:  # the group was lost meanwhile: stop spending compute
                job.dropped = True
                self._put(PassWrite(job, last=True))
                return
            self.status.pass_started()
            res = next(passes)
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

    def _next_item(self):
        """The next window (or END / DRAINED / a crash / None), taken early if ``_take_next_early`` did."""
        if self._taken_early is not _NOTHING:
            item, self._taken_early = self._taken_early, _NOTHING
            return item
        return self.reader.next_window(timeout_s=0.5)

    def _take_next_early(self, busy) -> None:
        """A window's last pass is queued and not yet read back: if the reader has the next window before the
        device is done with that pass (``busy()``), take it and queue its first pass behind (lookahead across
        windows), so the device keeps working while this window's last results become records and the next
        window starts. The wait is the one for the pass's scores anyway; after it, nothing waits for the reader."""
        if self._taken_early is not _NOTHING:
            return  # at most one window ahead
        item = wait_while(self.reader.next_window, busy)
        if item is None:
            return
        self._taken_early = item
        if isinstance(item, Window) and item.passes and item.epoch == self.guard.epoch:
            try:
                self._first_early = (item, self.clf.prelaunch(item.prepared, item.passes))
            except Exception as e:  # noqa: BLE001 - the window launches it again itself, where a failure is isolated
                self.log.warning("early_launch_failed", error=f"{type(e).__name__}: {e}", items=item.passes[0].size)

    def _put(self, item: PassWrite) -> None:
        self.writer.put(item, on_wait=lambda: self.status.set_phase("writing"))

    def _on_pass(self, m: WindowMetrics, index: int, res: PassResult) -> None:
        """After each forward call (main thread). A failed pass is logged whether it was split or held one ticket
        (nothing to split: its ticket failed alone), so every model failure has its line."""
        failed_alone = sum(isinstance(p, Exception) for p in res.predictions)
        if res.split_retries or failed_alone:
            self.log.warning("pass_failed_split", window=m.window, items=len(res.indices), failed_alone=failed_alone)
        self.log.info("pass", **pass_line(m.window, index, res.stats, split_retries=res.split_retries))
        prometheus.current().on_passes(res.stats)

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
        self.sizer.observe(m.stats.items, m.model_ms)  # before the slot is freed: the next read asks the new size
        self.status.add(windows=1, items=m.items, dead_lettered=m.dead_lettered)
        with self._summary_lock:
            self.summary.add(m)
        self.log.info("window", **m.line())
        prometheus.current().on_window(m)
        prometheus.current().on_graphs(self.clf.graph_stats())
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
            graphs = self.clf.graph_stats()  # None off CUDA
            self.log.info("summary", **line, **({"cuda_graphs": graphs} if graphs is not None else {}))

    def _commit(self, outcome: Outcome, w: Window) -> Outcome | None:
        """Write + ack what is still ours; on Redis errors retry (forever, capped backoff).

        None: the consumer group was lost (and recreated): the window must be dropped."""
        backoff = Backoff(self.s.reconnect_max_s)
        while True:
            try:
                stamp_latency(outcome.results)  # to this try: a write that waited out an outage says so
                written = self.sink.write(outcome)
                self.reader.written(outcome.ack_ids, w.epoch)
                written.log_skipped(self.log, retry=backoff.attempt)
                if backoff.reset():
                    self._count_reconnect()  # one wait that ended (as the RQ worker counts), not one per try
                    self.log.info("redis_reconnected", op="write")  # after the count: whoever sees it finds it counted
                return written.outcome
            except (PartialWriteError, WriteRefused):  # retrying cannot help: the worker stops
                raise
            except Exception as e:  # noqa: BLE001 - keep the window, keep trying: never drop, never ack blindly
                if is_nogroup(e):
                    try:
                        self.guard.recover(w.epoch, op="write", error=e)
                        return None
                    except Exception as again:  # noqa: BLE001 - Redis down while recreating: retry below
                        e = again
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
    def _finish(self, code: int, why: str) -> int:
        self.shutdown.stop.set()
        self._maybe_summary(force=True)
        self.keeper.stop()
        # after the keeper's last beat: a name found lost up to then exits 2 (drained, stopped or not)
        code, why = self.shutdown.outcome(code, why)
        self.reader.join(timeout=READER_JOIN_S)  # gone already unless the writer failed: it may be mid-read
        release(self.heartbeat, self.source, self.s.redis_url, reader_done=not self.reader.is_alive(), log=self.log)
        totals = self.status.snapshot()
        self.log.info(
            "worker_stopped",
            reason=why,
            windows=self.windows,
            items=totals["items"],
            dead_lettered=totals["dead_lettered"],
        )
        return code
