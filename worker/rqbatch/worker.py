"""``BatchWorker``: an RQ worker class that runs triage classify jobs N at a time, in-process.

``rq worker --worker-class worker.rqbatch.BatchWorker QUEUE`` keeps everything RQ
does around a job (registration, heartbeats, maintenance, suspension, signals,
--burst, the scheduler), and replaces the one-job-per-fork execution: when RQ hands
over a job, the worker takes up to TRIAGE_WINDOW_MAX_ITEMS - 1 more (waiting up to
TRIAGE_MAX_WAIT_MS), classifies them with the shared engine (length buckets +
prefix cache) and records each job's own result or failure through RQ.

No fork per job: the model is loaded once, in this process (CUDA does not survive
fork). Payloads are read with JSON only, whatever --serializer says, and only
``worker.rq_jobs.classify`` runs (see jobs.py).

Warm shutdown (SIGTERM/SIGINT): RQ's own handler sees the worker BUSY while a batch
is in hand, so it only sets the stop flag: intake stops, the batch finishes, the
process exits 0 and queued jobs stay queued. A second signal (after 1 s) is RQ's
cold shutdown: the batch is dropped and RQ's registry cleanup deals with it later.

A Redis that refuses writes for now (out of memory, a restart, a replica) is waited out, in RQ's loop as in a batch
(``waits``); a job whose hash RQ cannot read is failed where the worker meets it (``unreadable``), not left to crash
RQ's dequeue or its cleanup.
"""

from __future__ import annotations

import logging
import time

from rq import worker_registration
from rq.job import Job
from rq.job_lifecycle import call_exception_handlers
from rq.queue import Queue
from rq.registry import clean_registries
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException
from rq.utils import ensure_job_list, now
from rq.worker import WorkerStatus

from worker.engine.types import RunStats
from worker.observability import prometheus  # no-ops unless TRIAGE_METRICS_PORT is set
from worker.rqbatch import intake, outcome, unreadable
from worker.rqbatch.heartbeat import BatchHeartbeat
from worker.rqbatch.jobs import Entry, batch_timeout_s, check_job, job_hashes, parse_allowed
from worker.rqbatch.landing import Landed, Landing
from worker.rqbatch.payload import latency_ms
from worker.rqbatch.waits import RedisWaits, StopBeforeStart, stop_requests
from worker.stream.connection import is_passing

_RQ_HANDLER_LOGGERS = ("rq.worker", "rq.job", "rq.queue")


class BatchWorker(RedisWaits):
    """RQ worker for triage classify jobs: batches them through one engine loaded in this process."""

    def __init__(self, queues, *args, serializer=None, log_job_description: bool = True, **kwargs):
        # JSON, always: a pickle payload could run code while being read.
        self.requested_serializer = serializer
        names = [q.name if isinstance(q, Queue) else q for q in ensure_job_list(queues)]
        # Job descriptions carry the ticket text; it stays out of the logs.
        super().__init__(names, *args, serializer=JSONSerializer, log_job_description=False, **kwargs)
        self.settings = None
        self.clf = None
        self.tlog = None
        self.allowed_callbacks: frozenset[str] = frozenset()
        self._jobs_left: int | None = None
        self.slow_landing = None  # (Landing, Entry, landed) while RQ's handle_job_success records a batch's job

    # ------------------------------------------------------------ start-up
    def work(self, *args, **kwargs) -> bool:
        # --max-jobs counts jobs, not batches: keep RQ's loop from counting batches.
        self._jobs_left = kwargs.pop("max_jobs", None)
        return super().work(*args, **kwargs)

    def bootstrap(self, logging_level=None, date_format=None, log_format=None, **kwargs):
        with stop_requests() as stop:  # RQ's handlers come with its loop: a stop meanwhile killed the process
            self._start_up(logging_level)
        if stop.is_set():  # exit 0 before registering or taking a job
            self.handle_warm_shutdown_request()
            raise StopBeforeStart
        kwargs = {k: v for k, v in (("date_format", date_format), ("log_format", log_format)) if v is not None}
        super().bootstrap(logging_level, **kwargs)

    def _start_up(self, logging_level) -> None:
        from worker import preflight
        from worker.logs import configure_logging, get_logger
        from worker.model_start import start_model
        from worker.redact import register_secret

        register_secret(self.connection.connection_pool.connection_kwargs.get("password"))  # RQ's --url
        # Before the model: settings, TRIAGE_ names, task file, model location (RQ's --url is RQ's).
        self.settings, problems = preflight.load_settings(unknown=True)
        if self.settings is not None:
            problems = [p for p in problems if p.where != "TRIAGE_REDIS_URL"] + preflight.worker_problems(self.settings)
        fmt = self.settings.log_format if self.settings else preflight.log_format_from_env()
        level = logging_level or (self.settings.log_level if self.settings else "INFO")
        configure_logging(fmt, level, static={"worker": self.name})  # every line names the worker, libraries' too
        _route_rq_logs_to_root()
        self.tlog = get_logger("triage.rq", worker=self.name)
        if problems:
            for p in problems:
                self.tlog.error("config_invalid", setting=p.where, error=str(p))
            raise SystemExit(preflight.EXIT_CONFIG)
        # before the model: scrapes see "starting"
        if not prometheus.start_for(self.settings, self.tlog, windows=False):
            raise SystemExit(preflight.EXIT_CONFIG)
        if self.requested_serializer not in (None, "json", "rq.serializers.JSONSerializer", JSONSerializer):
            self.tlog.warning(
                "rq_serializer_ignored", requested=str(self.requested_serializer), used="rq.serializers.JSONSerializer"
            )
        self.allowed_callbacks = parse_allowed(self.settings.rq_allowed_callbacks)
        self.clf, facts = start_model(self.settings, self.tlog)  # the stream worker's start: warm, graphs captured
        metrics = prometheus.current()
        metrics.set_model(
            model=self.clf.model_name, device=str(self.clf.device), dtype=self.clf.dtype_name, consumer=self.name
        )
        metrics.set_phase("idle")
        self.tlog.info(
            "rq_worker_ready",
            model=self.clf.model_name,
            device=str(self.clf.device),
            dtype=self.clf.dtype_name,
            queues=self.queue_names(),
            window_max_items=self.batch_max_items(),
            max_wait_ms=round(intake.fill_wait_s(self.settings.max_wait_ms) * 1000),
            **facts,
        )
        if self.settings.max_wait_ms > intake.FILL_WAIT_MAX_S * 1000:
            self.tlog.warning(
                "rq_max_wait_capped",
                setting="TRIAGE_MAX_WAIT_MS",
                requested_ms=self.settings.max_wait_ms,
                used_ms=round(intake.FILL_WAIT_MAX_S * 1000),
                why="RQ's intermediate-queue cleanup fails a job held there over a minute",
            )

    def batch_max_items(self) -> int:
        """Jobs per batch at most: the stream worker's window cap (TRIAGE_WINDOW_MAX_ITEMS, or its CUDA default)."""
        from worker.assemble import window_max_items

        return window_max_items(self.settings, self.clf.device)

    # ---------------------------------------------------------- RQ's intake
    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        """RQ's (a refusing Redis waited out: ``waits``), failing each job whose hash RQ cannot read (``unreadable``)
        and dequeuing again: RQ's dequeue raises on one (it attaches the job id and queue), and its work loop quits.
        It attaches them to any error reading the popped job: one that passes by itself (BUSY) is waited out and the
        job read again, not failed (serving several queues, RQ popped it from no intermediate list: it was lost)."""
        while True:
            try:
                popped = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as e:
                job_id, queue = getattr(e, "job_id", None), getattr(e, "queue", None)
                if job_id is None or not isinstance(queue, Queue):
                    raise
                if not is_passing(e):
                    if not unreadable.fail_if_unreadable(self, job_id, queue, listed=self._popped_listed()):
                        raise
                    continue  # failed as unreadable: dequeue again
                popped = self._read_popped(job_id, queue)
                if popped is None:  # gone, or unreadable (failed)
                    continue
            if popped is None or not intake.left_as_done(self, *popped, self._popped_listed(), op="rq_dequeue"):
                return popped

    def _popped_listed(self) -> bool:
        """Whether RQ's dequeue moved the job into its intermediate list (one queue, Redis >= 6.2: its own rule)."""
        return len(self.queues) == 1 and intake.uses_intermediate_queue(self)

    def _read_popped(self, job_id: str, queue: Queue) -> tuple[Job, Queue] | None:
        """The job RQ popped, read once Redis answers, with RQ's steps after its dequeue; None if it is gone or
        unreadable (then failed)."""
        raw = self.until_written(lambda: job_hashes(self, [job_id])[0], op="rq_dequeue")
        if unreadable.fail_if_unreadable(self, job_id, queue, raw, listed=self._popped_listed()):
            return None
        job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
        job.restore(raw)
        job.redis_server_version = self.get_redis_server_version()
        self.reorder_queues(reference_queue=queue)
        self.heartbeat()
        return job, queue

    def clean_registries(self) -> None:
        """RQ 3's own (``BaseWorker.clean_registries``), the unreadable jobs of each intermediate list and the abandoned
        ones of its started registry failed first, under the queue's maintenance lock: RQ's cleanup of them raises on
        one, at every maintenance run (every
        worker start would quit), and two workers failing the same job outside the lock saved two failures. The lock
        is released however the run ends: a refusal waited out (``run_maintenance_tasks``) runs it again, where a
        lock left held skipped the queue's maintenance for 15 minutes."""
        for queue in self.queues:
            if queue.acquire_maintenance_lock():
                try:
                    self.log.info("Worker %s: cleaning registries for queue: %s", self.name, queue.name)
                    unreadable.fail_listed(self, queue)
                    unreadable.fail_abandoned(self, queue)
                    clean_registries(queue, self._exc_handlers)
                    worker_registration.clean_worker_registry(queue)
                    queue.intermediate_queue.cleanup(self, queue)
                finally:
                    self.until_written(queue.release_maintenance_lock, op="rq_dequeue")
        self.last_cleaned_at = now()

    def cleanup_execution(self, job: Job, pipeline, execution=None) -> None:
        """RQ's. Within RQ's handle_job_success for a batch's job (``outcome._record_slow``), first: was an earlier
        try whose reply was lost applied (then ``Landed``, nothing sent again), and this try's token (``landing``)."""
        if self.slow_landing is not None:
            landing, entry, landed = self.slow_landing
            landing.watch_late(pipeline)
            if entry.recorded:
                raise Landed(job.id)
            landing.mark(pipeline, then=landed)
        super().cleanup_execution(job, pipeline, execution)

    # -------------------------------------------------------------- a batch
    def execute_job(self, job: Job, queue: Queue) -> None:
        """RQ hands over one job; run it together with whatever else is queued."""
        self.set_state(WorkerStatus.BUSY)  # from here a SIGTERM means: finish this batch, then stop
        t0 = time.perf_counter()
        limit = self.batch_max_items()
        if self._jobs_left is not None:
            limit = max(1, min(limit, self._jobs_left))
        batch = [(job, queue)]
        self.until_written(lambda: intake.hold(self, job, queue), op="rq_hold")
        self._set_phase("reading")
        intake.fill(self, batch, limit, intake.fill_wait_s(self.settings.max_wait_ms))
        fill_ms = (time.perf_counter() - t0) * 1000
        self.run_batch([Entry(job=j, queue=q) for j, q in batch], fill_ms=fill_ms)
        self._stopped_job_id = None  # a stop-job command cannot cut one job out of a forward pass; it is void now
        self.set_state(WorkerStatus.IDLE)
        self._set_phase("idle")
        if self._jobs_left is not None:
            self._jobs_left -= len(batch)
            if self._jobs_left <= 0:
                self.log.info("Worker %s: finished executing the maximum number of jobs, quitting", self.name)
                self._stop_requested = True

    def run_batch(self, entries: list[Entry], fill_ms: float = 0.0) -> None:
        """Check, start, classify and record one batch of jobs; one log line."""
        t0 = time.perf_counter()
        for e in entries:  # before anything is recorded: pure checks, nothing of the job runs
            check_job(e, self.settings.max_text_bytes, self.allowed_callbacks)
        refused = [e for e in entries if e.error is not None]
        accepted = [e for e in entries if e.error is None]
        stats, split_retries = RunStats(), 0
        ok: list[Entry] = []
        if not accepted:
            outcome.fail_unstarted(self, refused)
        else:
            ttl = self.get_heartbeat_ttl(accepted[0].job)
            begun = Landing(self)
            self.until_written(lambda: outcome.start(self, accepted, ttl, begun), op="rq_start")
            for e in accepted:
                if e.dropped:  # canceled, deleted or ended while the batch filled: not run
                    self.tlog.warning("rq_job_left_before_start", job_id=e.job.id, queue=e.queue.name, status=e.dropped)
            accepted = [e for e in accepted if not e.dropped]
            # until every job is recorded: finished jobs' webhooks (up to 10 s each to an endpoint that does not
            # answer) must not let the failed ones' executions expire, or any worker's registry cleanup would fail
            # them a second time; its beats show a stop requested mid-pass
            with BatchHeartbeat(self, accepted, on_beat=self._show_stop):
                # refused jobs are never STARTED (no cleanup can find one "abandoned" and run its callback), and are
                # failed before the pass; after the start, their failure callbacks (60 s each at most) no longer
                # hold the accepted jobs in the intermediate list, where RQ's cleanup fails a job after a minute
                outcome.fail_unstarted(self, refused)
                self._set_phase("inferring")
                stats, split_retries = self._classify(accepted)
                self._set_phase("writing")
                ended = now()
                for e in accepted:
                    e.job.ended_at = ended
                outcome.run_callbacks(self, accepted)
                ok, landing, s = [e for e in accepted if e.error is None], Landing(self), self.settings
                self.until_written(
                    lambda: outcome.succeed(self, ok, s.results_stream, s.results_maxlen, self.clf.model_name, landing)
                )
                outcome.send_finished(ok)  # once all are written: a retry writes only what a refused try had not
                for e in accepted:
                    if e.error is not None:
                        outcome.fail(self, e)
        failed = [e for e in entries if e.error is not None]
        self._count(ok, failed, stats, split_retries)
        self.tlog.info(
            "rq_batch",
            jobs=len(entries),
            finished=len(ok),
            failed=len(failed),
            forward_passes=stats.passes,
            pass_sizes=stats.pass_sizes,
            split_retries=split_retries,
            padding_pct=round(stats.padding_pct, 1),
            prefix_tokens_reused=stats.prefix_tokens_reused,
            infer_ms=round(stats.infer_ms, 1),
            fill_ms=round(fill_ms, 1),
            total_ms=round(fill_ms + (time.perf_counter() - t0) * 1000, 1),
            queues=sorted({e.queue.name for e in entries}),
        )

    def _classify(self, entries: list[Entry]) -> tuple[RunStats, int]:
        """Tokenize + classify the checked jobs under one timeout; fills each entry's result or error.

        Pass by pass, as the stream worker does (``engine.isolation``): a pass that fails is re-run job by job,
        so one bad ticket fails only its own job. The batch's timeout fails every job still without a result.
        Returns the passes' stats and how many jobs were re-run alone."""
        from worker.engine.isolation import prepare_isolated, run_passes
        from worker.engine.types import InvalidTicket
        from worker.rqbatch.payload import job_result

        valid = [e for e in entries if e.error is None]
        timeout_s = batch_timeout_s([e.job for e in valid], self.queue_class.DEFAULT_TIMEOUT)
        stats, split_retries = RunStats(), 0
        try:
            for e, item in zip(valid, prepare_isolated(self.clf.prepare, [e.text for e in valid])):
                if isinstance(item, InvalidTicket):
                    e.fail(item)
                else:
                    e.item = item
            ready = [e for e in valid if e.error is None]
            items = [e.item for e in ready]
            if ready:
                with self.death_penalty_class(timeout_s, JobTimeoutException, job_id=ready[0].job.id):
                    plan = self.clf.plan(items)
                    for res in run_passes(self.clf.classify_passes, plan, items, fatal=(JobTimeoutException,)):
                        stats.merge(res.stats)
                        split_retries += res.split_retries
                        prometheus.current().on_passes(res.stats)
                        for i, pred in zip(res.indices, res.predictions):
                            if isinstance(pred, Exception):
                                ready[i].fail(pred)
                            else:
                                ready[i].pred, ready[i].result = pred, job_result(pred, self.clf.model_name)
        except Exception as exc:  # the batch's timeout, or tokenizing failed: each job without a result fails with it
            for e in valid:
                if e.error is None and e.result is None:
                    e.fail(exc)
        return stats, split_retries

    def _count(self, ok: list[Entry], failed: list[Entry], stats: RunStats, split_retries: int) -> None:
        """The batch in the stream worker's ticket, token and CUDA graph metrics (a failed job counts as a dead
        letter would; window and queue metrics are the stream's: RQ's queues are ``rq info``'s)."""
        metrics = prometheus.current()
        metrics.on_run(stats, split_retries)
        results = [{"latency_ms": latency_ms(e.job), "tokens": e.pred.n_tokens} for e in ok]
        metrics.on_settled(results, [str(e.error[1]) for e in failed])
        metrics.on_graphs(self.clf.graph_stats())

    def _set_phase(self, phase: str) -> None:
        """The metrics phase, or ``stopping`` once a warm shutdown was requested: the signal handler only sets
        RQ's flag (a metric's lock taken inside a handler could deadlock), this shows it at the next step."""
        prometheus.current().set_phase("stopping" if self._stop_requested else phase)

    def _show_stop(self) -> None:
        if self._stop_requested:
            self._set_phase("stopping")

    def teardown(self) -> None:
        self._set_phase("stopping")  # --burst done, --max-jobs reached, or a stop while idle
        super().teardown()

    def unsubscribe(self) -> None:
        """RQ's, without its chance hang of up to a minute at exit. RQ sends UNSUBSCRIBE, then stops the pub/sub
        thread, which redis-py >= 8 joins with no limit; a thread that read the reply before the stop waits 60 s
        (RQ's ``sleep_time``) for a new subscription. Here the thread is told to stop first, so that reply ends it.
        Seen as a --burst worker taking 60 s to exit, its death key (60 s TTL) gone by then."""
        thread = self.pubsub_thread
        if not thread:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        thread._running.clear()  # redis-py's PubSubWorkerThread loop flag (5.0 to 8.x; a guard test pins it)
        self.pubsub.unsubscribe()
        thread.join(timeout=1)
        self.pubsub.close()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Executions live job_monitoring_interval + 60 s between heartbeats (BatchHeartbeat keeps them alive)."""
        return int(self.job_monitoring_interval) + 60

    # ------------------------------------------------------------- errors
    def handle_exception(self, job: Job, *exc_info) -> None:
        """RQ's exception-handler chain, logged without the job's arguments (they hold ticket text)."""
        exc = exc_info[1]
        self.log.error(
            "Worker %s: job %s failed: %s: %s",
            self.name,
            job.id,
            type(exc).__name__,
            exc,
            extra={"queue": job.origin, "job_id": job.id},
        )
        call_exception_handlers(self._exc_handlers, job, *exc_info)


def _route_rq_logs_to_root() -> None:
    """RQ's CLI gives its loggers their own plain-text handlers; send them through triage's one chain instead."""
    from rq.logutils import ColorizingStreamHandler

    for name in _RQ_HANDLER_LOGGERS:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if isinstance(h, ColorizingStreamHandler):
                lg.removeHandler(h)
        if not lg.handlers:
            lg.propagate = True
