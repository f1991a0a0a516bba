"""Recording a batch in RQ's own terms, so registries, results, retries and dashboards keep working.

Each step mirrors what RQ's ``BaseWorker`` does for one job, using RQ's own
building blocks (Execution, Job, Result, the worker's handle_* methods):

* refused: a job check_job refused is never STARTED, and is failed before the batch's pass (once the
  others are started: its failure callback does not hold them in the intermediate list): RQ's
  registry cleanup (in any process) runs the failure callback of a STARTED job it finds
  abandoned, and a refused job's callbacks must never be imported or run anywhere;
* start: ``prepare_execution`` + ``prepare_job_execution`` for every accepted job, one pipeline
  (Execution + StartedJobRegistry, status STARTED, out of the intermediate queue);
* callbacks: as in RQ's ``_finalize_success`` / ``_finalize_failure``, before anything is recorded;
* success: ``handle_job_success`` minus dependents/repeats, for all plain jobs in ONE
  MULTI/EXEC that also mirrors each label to the triage results stream. Jobs with
  dependents (WATCHed, so one added meanwhile is seen), repeats or rate limits go
  through RQ's own ``handle_job_success`` one by one; the finished webhooks once all are written;
* failure: exception handlers, then what ``handle_job_failure`` writes (Retry honoured,
  FailedJobRegistry, failed Result), raising where RQ's logs a refused write (``failure``).

Every write here is waited out while Redis refuses it (``RedisWaits.until_written``); a success or failure whose
reply was lost is not applied again (``landing``).
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import redis
from rq.callbacks import execute_failure_callback, execute_success_callback
from rq.executions import Execution
from rq.job import JobStatus
from rq.utils import now
from rq.worker import WorkerStatus

from worker.rqbatch.failure import record_failure
from worker.rqbatch.intake import DONE, uses_intermediate_queue
from worker.rqbatch.jobs import Entry, unlist
from worker.rqbatch.landing import Landed, Landing
from worker.rqbatch.payload import latency_ms, rq_stream_id
from worker.stream.messages import as_text
from worker.stream.records import result_fields

if TYPE_CHECKING:
    from rq.worker import BaseWorker


# A job's status, or false when its hash is gone: one round trip for a batch's jobs, on the watched connection.
_STATUSES = "local out = {} for i, k in ipairs(KEYS) do out[i] = redis.call('HGET', k, 'status') end return out"
_LEFT = {s.value for s in DONE}


def start(worker: BaseWorker, entries: list[Entry], ttl: int, landing: Landing) -> None:
    """Mark every job STARTED with its own Execution, as RQ does right before running a job.

    A job canceled, deleted or otherwise ended while its batch filled (it waited in the intermediate list, out of
    the queue, where RQ's ``cancel`` and ``delete`` do not reach) is not started: it leaves the list and its entry is
    marked ``dropped`` (it ran, and a deleted one's hash was written back whole). The job keys are WATCHed from that
    read to the EXEC, so a change meanwhile is read again.

    Safe to call again after Redis refused it (``RedisWaits.until_written``), with the same ``landing``: a refused
    MULTI/EXEC applies nothing, and of the tries whose replies were lost at most one is applied, even one reaching
    Redis late (after the success: it set the job STARTED again, its execution back in the started registry, and
    the job was failed as abandoned once that expired). The applied try's Executions are the jobs' (and
    ``worker.executions``). A job leaving its intermediate list also loses RQ's first sighting of it there: kept
    (24 h), a retried job listed again was failed as "stuck" at once."""
    while True:
        try:
            return _start(worker, entries, ttl, landing)
        except redis.WatchError:  # a job changed after its read (or the reply was lost): read and settle again
            continue


def _start(worker: BaseWorker, entries: list[Entry], ttl: int, landing: Landing) -> None:
    drop_intermediate = uses_intermediate_queue(worker)
    keys = [e.job.key for e in entries]
    with worker.connection.pipeline() as pipe:
        landing.watch(pipe, *keys)
        statuses = pipe.immediate_execute_command("EVAL", _STATUSES, len(keys), *keys)
        if landing.settle(pipe):
            return
        text = [as_text(st) if st else "deleted" for st in statuses]  # no hash: deleted
        left = {e.job.id: st for e, st in zip(entries, text) if st == "deleted" or st in _LEFT}
        run = [e for e in entries if e.job.id not in left]
        pipe.multi()
        worker.heartbeat(max(ttl, worker.worker_ttl + 60), pipeline=pipe)
        executions = []
        for e in run:
            executions.append(Execution.create(e.job, ttl, pipeline=pipe, worker_name=worker.name))
            e.job.heartbeat(now(), ttl, pipeline=pipe)
            e.job.prepare_for_execution(worker.name, pipeline=pipe)
            pipe.persist(e.job.key)
        for e in entries:
            if drop_intermediate:
                unlist(pipe, e.queue, e.job.id)
        worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
        landing.execute(pipe, then=functools.partial(_started, worker, entries, run, executions, left))


def _started(
    worker: BaseWorker, entries: list[Entry], run: list[Entry], executions: list[Execution], left: dict[str, str]
) -> None:
    for e, execution in zip(run, executions):
        e.execution = execution
        worker.executions[execution.id] = execution
    for e in entries:
        if e.job.id in left:
            e.dropped = left[e.job.id]


def run_callbacks(worker: BaseWorker, entries: list[Entry]) -> None:
    """Success callbacks (a raising one fails its job, as in RQ), then failure callbacks of failed jobs
    (a raising one replaces the job's error, as in RQ). Only callbacks allowed by check_job run."""
    for e in entries:
        if e.error is None and e.callbacks_ok and e.job.success_callback is not None:
            try:
                execute_success_callback(e.job, worker.death_penalty_class, e.result)
            except Exception:
                e.error = sys.exc_info()  # type: ignore[assignment]
    for e in entries:
        if e.error is not None and e.callbacks_ok and e.job.failure_callback is not None:
            try:
                execute_failure_callback(e.job, worker.death_penalty_class, *e.error)
            except Exception:
                e.error = sys.exc_info()  # type: ignore[assignment]


def succeed(
    worker: BaseWorker, entries: list[Entry], results_stream: str, results_maxlen: int, model: str, landing: Landing
) -> None:
    """Record the successful jobs not recorded yet (see module doc) and mirror each label to the results stream.

    Safe to call again while Redis refuses part of it (``until_written``), with the same ``landing``: a plain job's
    record and mirror are one MULTI/EXEC; a slow job's mirror, after RQ's handle_job_success, is written by the next
    try if it was refused (``Entry.mirrored``); a try whose reply was lost is not sent again if it landed. Each try
    starts from the repeat count each job had (RQ's Repeat.schedule counts down in memory before EXEC). Webhooks are
    not sent here but once all are written (``send_finished``): a try refused after some jobs were recorded left
    theirs unsent."""
    landing.settle()
    todo = [e for e in entries if not e.recorded]
    for e in todo:
        e.job._result = e.result
        e.job._status = JobStatus.FINISHED
        if e.repeats is None:
            e.repeats = (e.job.repeats_left, e.job.repeat_intervals)
        e.job.repeats_left, e.job.repeat_intervals = e.repeats
    plain: list[Entry] = []
    slow: list[Entry] = []
    for e in todo:
        (slow if e.job.has_rate_limit or e.job.repeats_left else plain).append(e)
    if plain:
        slow += _record_plain(worker, plain, landing, results_stream, results_maxlen, model)
    for e in slow:
        _record_slow(worker, e, landing)
    for e in entries:
        if e.recorded and not e.mirrored:  # a slow one's, or one a refused try recorded but did not mirror
            with worker.connection.pipeline() as pipe:
                landing.watch(pipe)
                landing.settle(pipe)
                if e.mirrored:  # by an earlier try, whose reply was lost
                    continue
                pipe.multi()
                _mirror(worker, e, pipe, results_stream, results_maxlen, model)
                landing.execute(pipe, then=lambda e=e: setattr(e, "mirrored", True))


def _record_plain(worker: BaseWorker, entries: list[Entry], landing: Landing, *mirror_args) -> list[Entry]:
    """The jobs without dependents recorded and mirrored in one MULTI/EXEC; returns those with dependents (WATCHed
    first, so one added meanwhile is seen)."""
    conn = worker.connection
    while True:
        with conn.pipeline() as tx:
            landing.watch(tx, *[e.job.dependents_key for e in entries])
            landing.settle(tx)
            entries = [e for e in entries if not e.recorded]  # an earlier try, whose reply was lost, recorded some
            with conn.pipeline(transaction=False) as check:  # after WATCH: a dependent added later aborts EXEC
                for e in entries:
                    check.exists(e.job.dependents_key)
                has_dependents = check.execute()
            plain = [e for e, dep in zip(entries, has_dependents) if not dep]
            if not plain:
                return entries
            tx.multi()
            for e in plain:
                _record_success(worker, e, tx)
                _mirror(worker, e, tx, *mirror_args)
            try:
                landing.execute(tx, then=functools.partial(_mark_recorded, plain))
            except redis.WatchError:  # a dependent added, an earlier try landed late, or the reply was lost
                continue  # again: the next WATCH reads which of them it was
        return [e for e in entries if not e.recorded]


def _mark_recorded(entries: list[Entry]) -> None:
    for e in entries:
        e.recorded = e.mirrored = True


def _record_slow(worker: BaseWorker, e: Entry, landing: Landing) -> None:
    """RQ's own handle_job_success (dependents, repeats, rate limits), its transaction carrying this try's token
    (``BatchWorker.cleanup_execution``): RQ sends it again itself on a WatchError, which is also how redis-py
    reports a reply lost with the connection, and that try is not applied again if the lost one landed. What RQ
    does after EXEC is then done here: the rate-limit slot freed, the dependents it made ready enqueued."""

    def landed() -> None:
        e.recorded = True
        worker._release_slot_safely(e.job)
        try:  # as RQ's maintenance recovers them; none is enqueued twice
            e.queue.ready_job_registry.cleanup()
        except Exception:  # noqa: BLE001 - left to RQ's maintenance, as RQ leaves a refused enqueue of them
            worker.log.exception("Worker %s: failed to enqueue the ready dependents of job %s", worker.name, e.job.id)

    worker.slow_landing = (landing, e, landed)
    try:
        worker.handle_job_success(
            job=e.job, queue=e.queue, started_job_registry=e.queue.started_job_registry, execution=e.execution
        )
    except Landed:
        return
    finally:
        worker.slow_landing = None
    landing.applied()
    e.recorded = True


def send_finished(entries: list[Entry]) -> None:
    """The finished webhooks of the recorded jobs, once each (RQ's send_webhooks logs a failed send, never raises)."""
    for e in entries:
        e.job.send_webhooks(JobStatus.FINISHED)


def _record_success(worker: BaseWorker, e: Entry, pipe) -> None:
    """BaseWorker.handle_job_success for a job without dependents, repeats or rate limit, into ``pipe``."""
    job = e.job
    worker.increment_successful_job_count(pipeline=pipe)
    worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
    result_ttl = job.get_result_ttl(worker.default_result_ttl)
    if result_ttl != 0:
        job._handle_success(
            result_ttl,
            pipeline=pipe,
            worker_name=worker.name,
            execution_id=e.execution.id,
            execution_started_at=e.execution.created_at,
            execution_ended_at=job.ended_at,
        )
    job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
    worker.cleanup_execution(job, pipeline=pipe, execution=e.execution)


def _mirror(worker: BaseWorker, e: Entry, pipe, stream: str, maxlen: int, model: str) -> None:
    fields = result_fields(
        e.job.id,
        e.pred,
        latency_ms=latency_ms(e.job),
        model=model,
        worker=worker.name,
        stream_id=rq_stream_id(e.job.id),
    )
    pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)


def fail_unstarted(worker: BaseWorker, entries: list[Entry]) -> None:
    """Fail the jobs check_job rejected, never STARTED (the batch's others may be: ``run_batch``).

    They never get an Execution, a StartedJobRegistry entry or the STARTED status, so no
    registry cleanup (here or in another worker, after a crash) can find one "abandoned" and
    run its failure callback. Only allowed failure callbacks run, here (``run_callbacks``).
    Each leaves the intermediate list with its failure (else RQ's cleanup of it would fail it again).
    """
    run_callbacks(worker, entries)  # every entry has an error: failure callbacks only
    for e in entries:
        fail(worker, e)


def fail(worker: BaseWorker, e: Entry) -> None:
    """RQ's failure path for one job (its failure callback already ran): exception handlers, then the failure
    saved (``failure.record_failure``), waiting out a Redis that refuses it: nothing of it runs twice."""
    job, exc_info = e.job, e.error
    assert exc_info is not None
    job._status = JobStatus.FAILED
    worker.handle_exception(job, *exc_info)
    retries_left, landing = job.retries_left, Landing(worker)
    worker.until_written(lambda: record_failure(worker, e, retries_left, landing), op="rq_fail")
