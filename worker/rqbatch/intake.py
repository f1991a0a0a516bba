"""Filling a batch: after RQ hands the worker one job, take up to N-1 more queued jobs.

Why not RQ's ``Queue.dequeue_any`` in a loop: that is two round trips per job.
Here one pipeline moves up to N job ids (the same LMOVE into the queue's
intermediate list RQ itself uses) and one more fetches all their hashes.

Every job the worker holds before it is STARTED sits in its queue's intermediate list, with one queue or several
(RQ itself pops without one when it serves several queues, and marks the job started at once; a batch holds
its jobs for the fill wait first): a worker killed meanwhile leaves them where RQ's maintenance finds them and
fails them (or re-queues them, with retries) instead of losing them.

Waiting for a batch to fill polls briefly instead of blocking in Redis, so a warm-shutdown request stops the intake
at once and no blocked pop can take a job after it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rq.job import Job
from rq.queue import Queue

if TYPE_CHECKING:
    from rq.worker import BaseWorker

POLL_S = 0.005
log = logging.getLogger("triage.rq")


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
        jobs = fetch_jobs(worker, ids)
        skipped = set(ids) - {j.id for j in jobs}
        if via_intermediate and skipped:  # RQ's intermediate-queue cleanup would raise on an unreadable one
            with conn.pipeline(transaction=False) as pipe:
                for job_id in skipped:
                    pipe.lrem(queue.intermediate_queue_key, 0, job_id)
                pipe.execute()
        out.extend((job, queue) for job in jobs)
    return out


def fetch_jobs(worker: BaseWorker, job_ids: list[str]) -> list[Job]:
    """The jobs behind ``job_ids`` in one round trip; gone or unreadable ones are skipped (as RQ does)."""
    if not job_ids:
        return []
    with worker.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(worker.job_class.key_for(job_id))
        raws = pipe.execute()
    jobs = []
    for job_id, raw in zip(job_ids, raws):
        if not raw:
            continue  # deleted after it was queued
        job = worker.job_class(job_id, connection=worker.connection, serializer=worker.serializer)
        try:
            job.restore(raw)
        except Exception as e:  # a corrupt hash must not take the batch down
            log.error("rq job %s is unreadable and was skipped: %s", job_id, e)
            continue
        jobs.append(job)
    return jobs


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
