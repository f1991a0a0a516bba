"""The run loop: take a window from the reader, classify it, write + ack it in one
transaction, log one line; keep the heartbeat alive; stop warm or cold.

Write failures (Redis gone) are retried with capped backoff for the batch in
hand. Before a retry the loop asks Redis which of the batch's entries are still
pending on this consumer and writes only those: if the lost EXEC reply hid a
commit, nothing is written twice; if another worker reclaimed them meanwhile,
that worker owns them now.
"""

from __future__ import annotations

import queue
import time

from worker.logs import get_logger
from worker.stream.classify import classify_isolated
from worker.stream.connection import Backoff, connect, is_transient
from worker.stream.health import Heartbeat
from worker.stream.metrics import BatchMetrics, Summary
from worker.stream.reader import DRAINED, END, Reader
from worker.stream.shutdown import Shutdown
from worker.stream.sink import Outcome, PartialWriteError, ResultSink
from worker.stream.source import StreamSource
from worker.stream.window import Window, to_outcome

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def run_worker(settings, *, drain: bool = False) -> int:
    """Run until a signal (or, with ``drain``, until the stream is empty); the exit code."""
    log = get_logger("triage.worker").bind(consumer=settings.consumer)
    shutdown = Shutdown(log)
    shutdown.install()
    from worker.engine.classifier import Classifier
    from worker.logs import route_transformers_logs

    route_transformers_logs()

    t0 = time.perf_counter()
    clf = Classifier.from_settings(settings)
    clf.classify(clf.prepare_valid(["warm-up ticket: the first real batch should not pay for lazy init"]))
    import torch

    log.info("model_loaded", model=clf.model_name, device=str(clf.device), dtype=clf.dtype_name, labels=list(clf.labels),
             prefix_tokens=clf.prefix_length, load_ms=round((time.perf_counter() - t0) * 1000),
             torch_threads=torch.get_num_threads())

    client = connect(settings.redis_url)
    source = StreamSource(client, settings.input_stream, settings.group, settings.consumer)
    if not _setup(source, settings, shutdown, log):
        if shutdown.stop.is_set():
            log.info("worker_stopped", reason=shutdown.reason or "stopped", batches=0, items=0, dead_lettered=0)
            return EXIT_OK
        return EXIT_CONFIG
    loop = _Loop(settings, clf, client, source, shutdown, log, drain)
    return loop.run()


def _setup(source: StreamSource, settings, shutdown: Shutdown, log) -> bool:
    """Create the group (waiting for Redis if needed) and refuse keys of the wrong type."""
    backoff = Backoff(settings.reconnect_max_s)
    while not shutdown.stop.is_set():
        try:
            created = source.ensure_group()
            for name in (settings.input_stream, settings.results_stream, settings.dead_letter_stream):
                kind = source.key_type(name)
                if kind not in ("none", "stream"):
                    log.error("wrong_key_type", key=name, type=kind, expected="stream", fix="rename the key or point TRIAGE_*_STREAM elsewhere")
                    return False
            if created:
                log.info("group_created", stream=settings.input_stream, group=settings.group, start_id="0")
            return True
        except Exception as e:  # noqa: BLE001
            if not is_transient(e):
                log.error("setup_failed", error=f"{type(e).__name__}: {e}")
                return False
            delay = backoff.failed(shutdown.stop)
            log.warning("redis_unavailable", op="setup", error=f"{type(e).__name__}: {e}", attempt=backoff.attempt, retried_after_s=round(delay, 2))
    return False


class _Loop:
    def __init__(self, settings, clf, client, source: StreamSource, shutdown: Shutdown, log, drain: bool):
        self.s = settings
        self.clf = clf
        self.source = source
        self.shutdown = shutdown
        self.log = log
        self.drain = drain
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
        )
        self.heartbeat = Heartbeat(
            client, settings.heartbeat_key_prefix, settings.consumer, settings.heartbeat_ttl_s,
            {"stream": settings.input_stream, "group": settings.group, "model": clf.model_name},
        )
        self.summary = Summary(settings.log_summary_s, time.monotonic())
        self.reader = Reader(
            source,
            clf.prepare,
            max_items=settings.max_batch_items,
            max_wait_ms=settings.max_wait_ms,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            max_text_bytes=settings.max_text_bytes,
            reconnect_max_s=settings.reconnect_max_s,
            stop=shutdown.stop,
            log=log,
            drain=drain,
            on_reconnect=self._count_reconnect,
        )
        self.batches = 0
        self.totals = {"items": 0, "dead_lettered": 0}

    def _count_reconnect(self) -> None:
        self.summary.reconnects += 1

    def run(self) -> int:
        self._beat(force=True)
        self.reader.start()
        self.log.info("worker_ready", heartbeat_key=self.heartbeat.key, results_stream=self.s.results_stream,
                      dead_letter_stream=self.s.dead_letter_stream)
        code, why = EXIT_OK, "stopped"
        while True:
            try:
                item = self.reader.queue.get(timeout=0.5)
            except queue.Empty:
                item = None
            if isinstance(item, Window):
                if self.s.prefetch:
                    self.reader.permit.release()  # let the reader fetch + tokenize the next window now
                try:
                    self._handle(item)
                except PartialWriteError as e:
                    self.log.error("write_partially_failed", error=str(e), action="stopping: fix the key types, then restart")
                    return EXIT_FAILED
                finally:
                    if not self.s.prefetch:
                        self.reader.permit.release()
            elif item == END:
                why = self.shutdown.reason or "stopped"
                break
            elif item == DRAINED:
                why = "drained"
                break
            elif isinstance(item, BaseException):
                code, why = EXIT_FAILED, f"reader crashed: {type(item).__name__}: {item}"
                break
            self._beat()
            now = time.monotonic()
            if self.summary.due(now):
                self.log.info("summary", **self.summary.take(now))
        self._finish(why)
        return code

    # ------------------------------------------------------------------ batch
    def _handle(self, w: Window) -> None:
        self.batches += 1
        m = BatchMetrics(batch=self.batches, source=w.source, read_ms=w.read_ms, tokenize_ms=w.tokenize_ms,
                         backlog=w.backlog, pending=w.pending)
        preds, stats, m.split_retries = classify_isolated(self.clf.classify, w.prepared)
        if m.split_retries:
            self.log.warning("batch_failed_split", items=len(w.prepared), failed_alone=sum(isinstance(p, Exception) for p in preds))
        m.buckets, m.real_tokens, m.padded_tokens = stats.batches, stats.real_tokens, stats.padded_tokens
        m.prefix_tokens_reused, m.infer_ms = stats.prefix_tokens_reused, stats.infer_ms
        t0 = time.perf_counter()
        outcome, m.latencies_ms = to_outcome(w, preds, model=self.clf.model_name, worker=self.s.consumer)
        written = self._commit(outcome, w)
        m.write_ms = (time.perf_counter() - t0) * 1000
        m.items = len(written.results)
        m.dead_lettered = len(written.dead_letters)
        self.reader.in_flight.discard(w.ids)
        for d in written.dead_letters:
            self.log.warning("dead_lettered", stream_id=d["stream_id"], id=d.get("id"), reason=d["reason"], deliveries=int(d["deliveries"]))
        self.totals["items"] += m.items
        self.totals["dead_lettered"] += m.dead_lettered
        self.summary.add(m)
        self.log.info("batch", **m.line())

    def _commit(self, outcome: Outcome, w: Window) -> Outcome:
        """Write + ack; on Redis errors retry (forever, capped backoff) only what is still ours."""
        backoff = Backoff(self.s.reconnect_max_s)
        # Another worker may only reclaim after claim_idle_ms; a batch that took a good part of that must check.
        check_owner = (time.monotonic() - w.read_started_s) * 1000 >= self.s.claim_idle_ms / 2
        while True:
            try:
                if check_owner:
                    owned = self.source.owned(w.ids)
                    lost = len(w.ids) - len(owned)
                    if lost:
                        self.log.warning("entries_not_ours_anymore", count=lost, retry=backoff.attempt,
                                         note="acked by an earlier attempt, or reclaimed by another worker: not written again")
                    outcome = outcome.only(owned)
                self.sink.write(outcome)
                if backoff.reset():
                    self.log.info("redis_reconnected", op="write")
                return outcome
            except PartialWriteError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the batch, keep trying: never drop, never ack blindly
                check_owner = True
                self._count_reconnect()
                delay = backoff.failed()
                self.log.warning("redis_unavailable" if is_transient(e) else "write_failed", op="write",
                                 error=f"{type(e).__name__}: {e}", attempt=backoff.attempt, retried_after_s=round(delay, 2),
                                 entries=len(w.ids))

    # -------------------------------------------------------------- liveness
    def _beat(self, force: bool = False) -> None:
        try:
            status = {"batches": self.batches, **self.totals}
            self.heartbeat.beat(**status) if force else self.heartbeat.maybe_beat(**status)
        except Exception as e:  # noqa: BLE001 - a missed beat is what the TTL is for
            self.log.debug("heartbeat_failed", error=str(e))

    def _finish(self, why: str) -> None:
        self.shutdown.stop.set()
        now = time.monotonic()
        self.log.info("summary", **self.summary.take(now))
        try:
            self.heartbeat.clear()
            if self.source.own_pending_count() == 0:
                self.source.delete_consumer()  # unique per process: do not leave a trail of dead names in XINFO
        except Exception as e:  # noqa: BLE001
            self.log.warning("cleanup_failed", error=str(e))
        self.log.info("worker_stopped", reason=why, batches=self.batches, **self.totals)
