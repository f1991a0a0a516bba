"""Saving one job's failure in RQ's terms, in a way that can be tried again until Redis takes it.

Why not ``BaseWorker.handle_job_failure``: when Redis refuses its write (out of memory, a restart) it logs and
goes on. A started job then stays STARTED, and once its execution expires RQ's registry cleanup (any worker's)
finds it abandoned and runs its failure callback a second time; a job failed before its start stays in the
intermediate list until RQ's cleanup fails it as "stuck". ``record_failure`` writes what handle_job_failure writes
(RQ's own calls: Retry honoured, FailedJobRegistry, a failed Result, dependents, webhooks) but raises on a refusal;
the caller waits it out (``BatchWorker.until_written``). A refused MULTI/EXEC applies nothing, and each try starts
from the retry count the job had, so a retry counts down once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rq.job import JobStatus
from rq.job_lifecycle import format_exc_info

from worker.rqbatch.jobs import Entry

if TYPE_CHECKING:
    from redis.client import Pipeline
    from rq.worker import BaseWorker


def record_failure(
    worker: BaseWorker,
    e: Entry,
    retries_left: int | None,
    *,
    retry: bool = True,
    before: Callable[[Pipeline], object] | None = None,
) -> None:
    """Save ``e``'s failure (``e.error``) in one MULTI/EXEC, then what RQ does after it; raises if Redis refuses.

    ``retries_left``: the job's count before the first try (``job.retry`` counts down in memory before EXEC).
    ``retry=False``: failed whatever retries it has. ``before(pipe)``: more writes, first in the transaction.
    The job also leaves its queue's intermediate list (a job failed before its start is still there; before Redis
    6.2 there is none: a no-op)."""
    job, queue = e.job, e.queue
    job.retries_left = retries_left
    retrying = retry and job.should_retry
    exc_string = format_exc_info(e.error)
    execution = e.execution
    with worker.connection.pipeline() as pipe:
        if before is not None:
            before(pipe)
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
        worker.increment_failed_job_count(pipe)
        if job.started_at and job.ended_at:
            worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
        if retrying:
            job.retry(queue, pipe)
        pipe.lrem(queue.intermediate_queue_key, 0, job.id)
        pipe.execute()
    e.recorded = True  # from here its webhook may be slow: no more heartbeats for its execution
    if not retrying:
        job.send_webhooks(JobStatus.FAILED, exc_string=exc_string)
        worker._enqueue_dependents_safely(queue, job)
    worker._release_slot_safely(job)
