"""Filling a batch: after RQ hands the worker one job, take up to N-1 more queued jobs.

Why not RQ's ``Queue.dequeue_any`` in a loop: that is two round trips per job.
Here one pipeline moves up to N job ids (the same LMOVE into the queue's
intermediate list RQ itself uses) and one more fetches all their hashes.

Every job the worker holds before it is STARTED sits in its queue's intermediate list, with one queue or several
(RQ itself pops without one when it serves several queues, and marks the job started at once; a batch holds
its jobs for the fill wait first): a worker killed meanwhile leaves them where RQ's maintenance finds them and
fails them (or re-queues them, with retries) instead of losing them. RQ fails one it sees there over a minute, so a
batch waits at most FILL_WAIT_MAX_S to fill, whatever TRIAGE_MAX_WAIT_MS says.

Waiting for a batch to fill polls briefly instead of blocking in Redis, so a warm-shutdown request stops the intake
at once and no blocked pop can take a job after it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue

from worker.rqbatch import unreadable

if TYPE_CHECKING:
    from rq.worker import BaseWorker

POLL_S = 0.005
# RQ's intermediate-queue cleanup (any worker's maintenance) fails a job it sees listed on two runs over a minute
# apart (IntermediateQueue.should_be_cleaned_up): the jobs a batch holds there must be started well within that.
FILL_WAIT_MAX_S = 30.0


def uses_intermediate_queue(worker: BaseWorker) -> bool:
    """Jobs go through their queue's intermediate list (LMOVE: Redis >= 6.2, as RQ's own rule needs)."""
    return worker.get_redis_server_version() >= (6, 2, 0)


def hold(worker: BaseWorker, job: Job, queue: Queue) -> None:
    """The job RQ handed over, in its queue's intermediate list if RQ popped it without one (several queues)."""
    if len(worker.queues) > 1 and uses_intermediate_queue(worker):
        worker.connection.lpush(queue.intermediate_queue_key, job.id)


def drain(worker: BaseWorker, limit: int) -> list[tuple[Job, Queue]]:
    """Up to ``limit`` queued jobs, queues in the worker's priority order; never blocks."""
    out: list[tuple[Job, Queue]] = []
    conn = worker.connection
    via_intermediate = uses_intermediate_queue(worker)
    for queue in list(worker._ordered_queues):
        need = limit - len(out)
        if need <= 0:
            break
        if via_intermediate:
            with conn.pipeline(transaction=False) as pipe:
                for _ in range(need):
                    pipe.lmove(queue.key, queue.intermediate_queue_key)
                ids = [i for i in pipe.execute() if i is not None]
        else:
            ids = conn.lpop(queue.key, need) or []
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        out.extend((job, queue) for job in fetch_jobs(worker, ids, queue))
    return out


def fetch_jobs(worker: BaseWorker, job_ids: list[str], queue: Queue) -> list[Job]:
    """The jobs behind ``job_ids`` (taken from ``queue``) in one round trip. Gone ones are skipped (as RQ does);
    unreadable ones are failed (``unreadable``): skipped, one would be in no registry. Either leaves the
    intermediate list: RQ's cleanup of it raises on an unreadable job."""
    if not job_ids:
        return []
    with worker.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(worker.job_class.key_for(job_id))
        raws = pipe.execute()
    jobs = []
    for job_id, raw in zip(job_ids, raws):
        job = worker.job_class(job_id, connection=worker.connection, serializer=worker.serializer)
        try:
            if not raw:
                raise NoSuchJobError(job_id)
            job.restore(raw)
        except Exception:  # deleted after it was queued, or a hash RQ cannot read: not a job of the batch
            unreadable.fail_if_unreadable(worker, job_id, queue, raw)
            continue
        jobs.append(job)
    return jobs


def fill_wait_s(max_wait_ms: float) -> float:
    """How long a batch waits to fill: TRIAGE_MAX_WAIT_MS, at most FILL_WAIT_MAX_S."""
    return min(max_wait_ms / 1000, FILL_WAIT_MAX_S)


def fill(worker: BaseWorker, batch: list[tuple[Job, Queue]], limit: int, max_wait_s: float) -> None:
    """Grow ``batch`` to ``limit`` jobs, waiting at most ``max_wait_s`` for more to arrive.

    Stops at once when a warm shutdown was requested: the batch in hand is then finished as is.
    """
    deadline = time.monotonic() + max_wait_s
    want = limit
    while len(batch) < limit and not worker._stop_requested:
        got = drain(worker, min(want, limit - len(batch)))
        if got:
            batch.extend(got)
            want = limit  # jobs are arriving: take all there are
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, POLL_S))
        want = 1  # the queue was empty: poll it with a single pop
