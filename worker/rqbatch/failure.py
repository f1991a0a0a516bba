"""Saving one job's failure in RQ's terms, in a way that can be tried again until Redis takes it.

Why not ``BaseWorker.handle_job_failure``: when Redis refuses its write (out of memory, a restart) it logs and
goes on. A started job then stays STARTED, and once its execution expires RQ's registry cleanup (any worker's)
finds it abandoned and runs its failure callback a second time; a job failed before its start stays in the
intermediate list until RQ's cleanup fails it as "stuck". ``record_failure`` writes what handle_job_failure writes
(RQ's own calls: Retry honoured, FailedJobRegistry, a failed Result, dependents, webhooks) but raises on a refusal;
the caller waits it out (``RedisWaits.until_written``). A refused MULTI/EXEC applies nothing, a try whose reply was
lost is not sent again if it landed (``landing``), and each try starts from the retry count the job had, so a retry
counts down once.

RQ's ``_stopped_job_id`` branch (a job stopped on request: STOPPED, never retried) is left out on purpose: a
stop-job command cannot cut one job out of a batch's forward pass, and the worker voids it after each batch.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from rq.defaults import DEFAULT_FAILURE_TTL
from rq.job import JobStatus
from rq.job_lifecycle import format_exc_info
from rq.results import Result

from worker.rqbatch.jobs import Entry, unlist
from worker.rqbatch.landing import Landing

if TYPE_CHECKING:
    from rq.worker import BaseWorker


def record_failure(
    worker: BaseWorker,
    e: Entry,
    retries_left: int | None,
    landing: Landing,
    *,
    retry: bool = True,
    drop: Collection[bytes] = (),
) -> bool:
    """Save ``e``'s failure (``e.error``) in one MULTI/EXEC, then what RQ does after it; raises if Redis refuses.

    ``retries_left``: the job's count before the first try (``job.retry`` counts down in memory before EXEC).
    ``landing``: the same for every try of this failure. ``retry=False``: failed whatever retries it has.
    ``drop``: fields removed from the job's hash in the same transaction (an unreadable job's); the hash is then
    WATCHed, and False returned, nothing written, if they are gone already (another worker failed the job).
    The job also leaves its queue's intermediate list (a job failed before its start is still there; before Redis
    6.2 there is none: a no-op), with RQ's first sighting of it there (else it comes back "stuck" if retried)."""
    job, queue = e.job, e.queue
    job.retries_left = retries_left
    retrying = retry and job.should_retry
    exc_string = format_exc_info(e.error)
    if not landing.settle() and not _saved(worker, e, landing, retrying, exc_string, drop):
        return False
    e.recorded = True  # from here its webhook may be slow: no more heartbeats for its execution
    if not retrying:
        job.send_webhooks(JobStatus.FAILED, exc_string=exc_string)
        worker._enqueue_dependents_safely(queue, job)
    worker._release_slot_safely(job)
    return True


def _saved(
    worker: BaseWorker, e: Entry, landing: Landing, retrying: bool, exc_string: str, drop: Collection[bytes]
) -> bool:
    """The failure's MULTI/EXEC; False, nothing written, if ``drop``'s fields are gone (another worker failed it)."""
    job, queue, execution = e.job, e.queue, e.execution
    with worker.connection.pipeline() as pipe:
        landing.watch(pipe, *([job.key] if drop else []))
        gone = drop and not any(pipe.hmget(job.key, *drop))
        if landing.settle(pipe):  # read last: an earlier try (whose reply was lost) that removed them is seen
            return True
        if gone:
            return False
        pipe.multi()
        if drop:
            pipe.hdel(job.key, *drop)  # first: the writes after it set fields again
        if not retrying:
            job.set_status(JobStatus.FAILED, pipeline=pipe)
        worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        if not worker.disable_default_exception_handler and not retrying:
            job._handle_failure(
                exc_string,
                pipeline=pipe,
                worker_name=worker.name,
                execution_id=execution.id if execution else None,
                execution_started_at=execution.created_at if execution else None,
                execution_ended_at=job.ended_at,
            )
            if job.failure_ttl is None:  # RQ keeps the job 1 year but saves its failed Result with no expiry
                pipe.expire(Result.get_key(job.id), DEFAULT_FAILURE_TTL)  # (~5 KB a failed job, for good)
        worker.increment_failed_job_count(pipe)
        if job.started_at and job.ended_at:
            worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
        if retrying:
            job.retry(queue, pipe)
        unlist(pipe, queue, job.id)
        landing.execute(pipe)
    return True
