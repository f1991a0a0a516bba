"""Jobs whose hash RQ cannot read (a field it cannot parse, e.g. ``timeout`` = "abc"): failed visibly, not lost.

RQ's ``Job.fetch`` raises on such a hash: its dequeue then ends the worker's work loop ("found an unhandled
exception, quitting") with the job in the intermediate list or, serving several queues, in no list at all; its
intermediate-queue cleanup raises on it at every maintenance run, so every worker start quits; a skip leaves it in
no registry. Here it fails as RQ fails a job (status failed, FailedJobRegistry, a failed Result whose reason names
each field and its value). It never runs and is never retried: its payload is not checked, none of its callbacks
run. The unreadable fields are removed (their values are in the reason) so that RQ reads the job again and
``FailedJobRegistry.requeue`` works, with RQ's defaults for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue

from worker.logs import get_logger
from worker.rqbatch.failure import record_failure
from worker.rqbatch.jobs import Entry, job_hashes
from worker.rqbatch.landing import Landing
from worker.rqbatch.payload import InvalidJob

if TYPE_CHECKING:
    from rq.worker import BaseWorker

log = get_logger("triage.rq")
_TEXT_FIELDS = {b"description", b"exc_info"}  # may hold ticket text: named, their values left out


def unreadable_fields(job: Job, raw: dict) -> dict[bytes, BaseException]:
    """The fields of ``raw`` (a job's HGETALL) that ``job.restore`` cannot read, each with its error.

    ``restore`` reads every field on its own beside ``data``, so each is tried alone with it. No ``data``:
    NoSuchJobError, as RQ itself treats that hash (a job that does not exist)."""
    if b"data" not in raw:
        raise NoSuchJobError(f"job hash {job.key} has no data")
    bad: dict[bytes, BaseException] = {}
    for field, value in raw.items():
        if field != b"data":
            try:
                job.restore({b"data": raw[b"data"], field: value})
            except Exception as e:  # noqa: BLE001 - whatever RQ raises on it makes the field unreadable
                bad[field] = e
    return bad


def salvage(job: Job, raw: dict, bad: dict[bytes, BaseException], queue: Queue) -> None:
    """``job`` restored from every field RQ can read; the queue it was taken from if its origin was unreadable."""
    job.restore({k: v for k, v in raw.items() if k not in bad})
    job.origin = job.origin or queue.name


def reason(raw: dict, bad: dict[bytes, BaseException]) -> str:
    """What the failed Result says: each unreadable field, its stored value (shortened) and RQ's error."""
    parts = []
    for field, err in sorted(bad.items()):
        name = field.decode(errors="replace")
        value = "" if field in _TEXT_FIELDS else "=" + repr(raw[field].decode(errors="replace")[:60])
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        parts.append(f"{name}{value} ({why})")
    return (
        f"RQ cannot read this job's hash: {', '.join(parts)}. The job never ran; the field(s) were removed so "
        "RQ reads the job again (a requeue runs it with RQ's defaults for them)."
    )


def fail_if_unreadable(worker: BaseWorker, job_id: str, queue: Queue, raw: dict | None = None) -> bool:
    """Fail the job ``job_id`` taken from ``queue`` if RQ cannot read its hash (``raw``, read here if not given).

    True if it was failed (here or by another worker) or is gone, False if it reads. Waits out a Redis that
    refuses it, so the job stays listed until its failure is saved; a worker that meets the same job meanwhile (its
    fill, another's maintenance) finds the fields gone, under WATCH, and fails it no second time."""
    job = worker.job_class(job_id, connection=worker.connection, serializer=worker.serializer)
    if raw is None:
        raw = worker.until_written(lambda: worker.connection.hgetall(job.key), op="rq_fill")
    try:
        bad = unreadable_fields(job, raw) if raw else {}
    except NoSuchJobError:
        raw = {}
    if not raw:  # deleted after it was queued: RQ skips it too; only the intermediate list keeps its id
        first_seen = queue.intermediate_queue.get_first_seen_key(job_id)
        worker.until_written(lambda: _unlist(worker, queue, job_id, first_seen), op="rq_fill")
        return True
    if not bad:
        return False
    salvage(job, raw, bad, queue)
    fields = sorted(f.decode(errors="replace") for f in bad)
    log.error("rq_job_unreadable", job_id=job_id, queue=queue.name, fields=fields)
    entry = Entry(job=job, queue=queue)
    entry.fail(InvalidJob(reason(raw, bad)))
    landing = Landing(worker)
    while True:
        try:
            worker.until_written(
                lambda: record_failure(worker, entry, None, landing, retry=False, drop=list(bad)), op="rq_fail"
            )
            return True
        except redis.WatchError:  # its hash changed (another worker failing it?), or the connection died: again
            continue


def _unlist(worker: BaseWorker, queue: Queue, job_id: str, first_seen: str) -> None:
    with worker.connection.pipeline() as pipe:
        pipe.lrem(queue.intermediate_queue_key, 0, job_id)
        pipe.delete(first_seen)
        pipe.execute()


def fail_listed(worker: BaseWorker, queue: Queue) -> None:
    """Fail every unreadable job in ``queue``'s intermediate list, before RQ's cleanup of it (which raises on one)."""
    ids = [i.decode() for i in worker.connection.lrange(queue.intermediate_queue_key, 0, -1)]
    if not ids:
        return
    for job_id, raw in zip(ids, job_hashes(worker, ids)):
        if raw:  # one with no hash RQ's cleanup removes by itself
            fail_if_unreadable(worker, job_id, queue, raw)
