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

A fill that Redis refuses (out of memory: LMOVE is a write; a restart) stops, and the batch in hand goes on (its
start waits for Redis). The LMOVE pipeline has no MULTI, so some moves may have been applied before the refusal:
their replies name the jobs, which join the batch; the refused ones were not moved and stay queued. Only a pipeline
whose replies are lost (the connection dropped) leaves jobs it moved in the intermediate list, for RQ's cleanup.

``rq suspend``: RQ checks it only at the top of its work loop, before the job it dequeues; the fill checks it too
(``suspended``: one EXISTS per poll), so a suspension stops a filling batch and the batch in hand runs, as with a warm
stop. It used to take every job that arrived during the fill wait (a whole backlog enqueued after ``rq suspend``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.suspension import WORKERS_SUSPENDED

from worker.rqbatch import unreadable
from worker.rqbatch.jobs import job_hashes, unlist, unlist_now
from worker.stream.connection import is_passing

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
    """The job RQ handed over, in its queue's intermediate list if RQ popped it without one (several queues).
    Safe to call again (``until_written``): listed once, whether or not a try's reply was lost. RQ's first sighting
    of it there is from an earlier time it was listed: gone, or RQ's cleanup would fail it as "stuck" at once."""
    if len(worker.queues) > 1 and uses_intermediate_queue(worker):
        with worker.connection.pipeline() as pipe:
            unlist(pipe, queue, job.id)
            pipe.lpush(queue.intermediate_queue_key, job.id)
            pipe.execute()


class FillRefused(Exception):
    """Redis refused the fill (``error``, one that passes by itself); ``jobs``: those it took before, in hand."""

    def __init__(self, jobs: list[tuple[Job, Queue]], error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.jobs, self.error = jobs, error


def suspended(worker: BaseWorker) -> bool:
    """Whether ``rq suspend`` is in force (RQ's key, which ``rq.suspension.is_suspended`` reads in a MULTI that Redis 7
    refuses at maxmemory: one plain EXISTS here). Raises FillRefused, no jobs, if Redis refuses it for now."""
    try:
        return bool(worker.connection.exists(WORKERS_SUSPENDED))
    except Exception as e:
        if not is_passing(e):
            raise
        raise FillRefused([], e) from e


def drain(worker: BaseWorker, limit: int) -> list[tuple[Job, Queue]]:
    """Up to ``limit`` queued jobs, queues in the worker's priority order; never blocks. Raises FillRefused if Redis
    refused a move, with the jobs moved before it."""
    out: list[tuple[Job, Queue]] = []
    conn = worker.connection
    via_intermediate = uses_intermediate_queue(worker)
    for queue in list(worker._ordered_queues):
        need = limit - len(out)
        if need <= 0:
            break
        refused = None
        if via_intermediate:
            try:
                with conn.pipeline(transaction=False) as pipe:
                    for _ in range(need):
                        pipe.lmove(queue.key, queue.intermediate_queue_key)
                    replies = pipe.execute(raise_on_error=False)
            except Exception as e:  # no replies (a lost connection): what it moved is left to RQ's cleanup
                if not is_passing(e):
                    raise
                raise FillRefused(out, e) from e
            refused = next((r for r in replies if isinstance(r, Exception)), None)
            if refused is not None and not is_passing(refused):
                raise refused
            ids = [r for r in replies if r is not None and not isinstance(r, Exception)]  # each one moved
        else:
            ids = conn.lpop(queue.key, need) or []
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        out.extend((job, queue) for job in fetch_jobs(worker, ids, queue))
        if refused is not None:
            raise FillRefused(out, refused)
    return out


def fetch_jobs(worker: BaseWorker, job_ids: list[str], queue: Queue) -> list[Job]:
    """The jobs behind ``job_ids`` (taken from ``queue``) in one round trip. Gone ones are skipped (as RQ does);
    unreadable ones are failed (``unreadable``): skipped, one would be in no registry. Either leaves the
    intermediate list: RQ's cleanup of it raises on an unreadable job. The jobs are taken: read until Redis answers."""
    if not job_ids:
        return []
    raws = worker.until_written(lambda: job_hashes(worker, job_ids), op="rq_fill")
    listed = uses_intermediate_queue(worker)  # drain's LMOVE: else an LPOP, in no list
    jobs = []
    for job_id, raw in zip(job_ids, raws):
        job = worker.job_class(job_id, connection=worker.connection, serializer=worker.serializer)
        try:
            if not raw:
                raise NoSuchJobError(job_id)
            job.restore(raw)
        except Exception:  # deleted after it was queued, or a hash RQ cannot read: not a job of the batch
            unreadable.fail_if_unreadable(worker, job_id, queue, raw, listed=listed)
            continue
        if not left_as_done(worker, job, queue, listed=listed):
            jobs.append(job)
    return jobs


# Statuses a queued job never has: every enqueue, retry, repeat and requeue sets QUEUED before it pushes the id.
DONE = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)


def left_as_done(worker: BaseWorker, job: Job, queue: Queue, listed: bool, op: str = "rq_fill") -> bool:
    """Whether ``job`` is a stale copy of a job already done (finished, failed, stopped or canceled): an id queued
    twice (a resent enqueue) whose first copy ran in an earlier batch. RQ would run it again (a second Result, a
    second webhook; a canceled job run). It leaves the intermediate list (if it was moved there) and is not run."""
    status = job.get_status(refresh=False)
    if status not in DONE:
        return False
    if listed:  # off the list, with RQ's first sighting of it there (as every job leaving it: ``hold``, the start)
        worker.until_written(lambda: unlist_now(worker.connection, queue, job.id, count=1), op=op)
    note = "already done: not run again"
    worker.tlog.warning("rq_job_queued_twice", job_id=job.id, queue=queue.name, status=status.value, note=note)
    return True


def fill_wait_s(max_wait_ms: float) -> float:
    """How long a batch waits to fill: TRIAGE_MAX_WAIT_MS, at most FILL_WAIT_MAX_S."""
    return min(max_wait_ms / 1000, FILL_WAIT_MAX_S)


def fill(worker: BaseWorker, batch: list[tuple[Job, Queue]], limit: int, max_wait_s: float) -> None:
    """Grow ``batch`` to ``limit`` jobs, waiting at most ``max_wait_s`` for more to arrive.

    Stops at once when a warm shutdown was requested, when ``rq suspend`` is in force (logged: checked before each
    drain) or when Redis refuses a move (logged): the batch in hand is then finished as is.
    """
    deadline = time.monotonic() + max_wait_s
    want = limit
    while len(batch) < limit and not worker._stop_requested:
        try:
            if suspended(worker):
                worker.tlog.info("rq_fill_suspended", batch=len(batch), note="`rq suspend`: the batch in hand runs")
                return
            if worker._stop_requested:  # came during that round trip: the jobs still queued are another worker's
                return
            got = drain(worker, min(want, limit - len(batch)))
        except FillRefused as refused:
            _add_new(worker, batch, refused.jobs)
            worker.tlog.warning(
                "redis_unavailable", op="rq_fill", error=str(refused), batch=len(batch), note="the batch goes on"
            )
            return
        if got:
            _add_new(worker, batch, got)
            want = limit  # jobs are arriving: take all there are
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, POLL_S))
        want = 1  # the queue was empty: poll it with a single pop


def _add_new(worker: BaseWorker, batch: list[tuple[Job, Queue]], got: list[tuple[Job, Queue]]) -> None:
    """``got`` onto ``batch``, less the jobs in it already: an id queued twice (an enqueue whose reply was lost, sent
    again by a client with retries, as redis-py's default ``Redis()`` is) was started, run and recorded twice. Its
    extra copies leave the intermediate list with its start (LREM of every copy)."""
    seen = {job.id for job, _ in batch}
    for job, queue in got:
        if job.id in seen:
            worker.tlog.warning("rq_job_queued_twice", job_id=job.id, queue=queue.name, note="run once")
            continue
        seen.add(job.id)
        batch.append((job, queue))
