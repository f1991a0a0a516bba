"""Jobs whose hash RQ cannot read (a field it cannot parse, e.g. ``timeout`` = "abc"): failed visibly, not lost.

RQ's ``Job.fetch`` raises on such a hash: its dequeue then ends the worker's work loop ("found an unhandled
exception, quitting") with the job in the intermediate list or, serving several queues, in no list at all; its
intermediate-queue cleanup raises on it at every maintenance run, so every worker start quits; a skip leaves it in
no registry. Here it fails as RQ fails a job (status failed, FailedJobRegistry, a failed Result whose reason names
each field and its value). It never runs and is never retried: its payload is not checked, none of its callbacks
run. The unreadable fields are removed (their values are in the reason) so that RQ reads the job again and
``FailedJobRegistry.requeue`` works, with RQ's defaults for them.

A job key that is not a hash (WRONGTYPE: another program writing under RQ's names) fails alike, its key left as it is:
it is not RQ's to rewrite, and RQ's failure writes into it (under EXEC only that command fails; the rest applies).
Nothing in the key marks the failure, so it is saved only while the job is still where the worker met it (its
intermediate list, the started registry), and takes it out of there: a second worker meeting it finds it gone.

An abandoned job (STARTED, its execution expired: its worker died) that RQ cannot read raised in RQ's registry
cleanup at every maintenance run, so every worker start quit too: it is failed first (``fail_abandoned``), as
"abandoned" (it may have run). One whose hash says it ended is a leftover entry: only removed, as RQ's cleanup does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import format_exc_info
from rq.queue import Queue
from rq.results import Result
from rq.utils import current_timestamp

from worker.logs import get_logger
from worker.observability import prometheus
from worker.rqbatch.failure import record_failure
from worker.rqbatch.jobs import Entry, job_hashes, not_a_hash, unlist, unlist_now
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


def reason(raw: dict, bad: dict[bytes, BaseException], abandoned: bool = False) -> str:
    """What the failed Result says: each unreadable field, its stored value (shortened) and RQ's error."""
    parts = []
    for field, err in sorted(bad.items()):
        name = field.decode(errors="replace")
        value = "" if field in _TEXT_FIELDS else "=" + repr(raw[field].decode(errors="replace")[:60])
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        parts.append(f"{name}{value} ({why})")
    return (
        f"RQ cannot read this job's hash: {', '.join(parts)}. {_ran(abandoned)}; the field(s) were removed so "
        "RQ reads the job again (a requeue runs it with RQ's defaults for them)."
    )


def _ran(abandoned: bool) -> str:
    return "Its worker stopped with it started (abandoned): it may have run" if abandoned else "The job never ran"


def fail_if_unreadable(
    worker: BaseWorker, job_id: str, queue: Queue, raw=None, *, listed: bool, started: str | None = None
) -> bool:
    """Fail the job ``job_id`` taken from ``queue`` if RQ cannot read it (``raw``: its HGETALL, or the error for a key
    that is not a hash; read here if not given). ``listed``: met in the queue's intermediate list; ``started``: met in
    its started registry, abandoned (the registry's member for it).

    True if it was failed (here or by another worker) or is gone, False if it reads. Waits out a Redis that
    refuses it, so the job stays listed until its failure is saved; a worker that meets the same job meanwhile (its
    fill, another's maintenance) finds the fields gone, under WATCH, and fails it no second time."""
    job = worker.job_class(job_id, connection=worker.connection, serializer=worker.serializer)
    if raw is None:
        raw = worker.until_written(lambda: job_hashes(worker, [job_id])[0], op="rq_fill")
    if not_a_hash(raw):
        _fail_not_a_hash(worker, job, queue, listed=listed, started=started)
        return True
    try:
        bad = unreadable_fields(job, raw) if raw else {}
    except NoSuchJobError:
        raw = {}
    if not raw:  # deleted after it was queued: RQ skips it too; only the intermediate list keeps its id
        worker.until_written(lambda: unlist_now(worker.connection, queue, job_id), op="rq_fill")
        return True
    if not bad:
        return False
    salvage(job, raw, bad, queue)
    fields = sorted(f.decode(errors="replace") for f in bad)
    if started and b"status" not in bad and job.get_status(refresh=False) != JobStatus.STARTED:
        log.warning("rq_job_unreadable", job_id=job_id, queue=queue.name, fields=fields, note="ended: entry removed")
        worker.until_written(lambda: worker.connection.zrem(queue.started_job_registry.key, started), op="rq_fail")
        return True
    log.error("rq_job_unreadable", job_id=job_id, queue=queue.name, fields=fields, **_abandoned(started))
    entry = Entry(job=job, queue=queue)
    if started:  # its execution, out of the started registry with the failure
        entry.execution = Execution.from_composite_key(started, worker.connection)
        entry.execution.created_at = job.started_at or entry.execution.created_at
    entry.fail(InvalidJob(reason(raw, bad, abandoned=bool(started))))
    landing = Landing(worker)
    while True:
        try:
            saved = worker.until_written(
                lambda: record_failure(worker, entry, None, landing, retry=False, drop=list(bad)), op="rq_fail"
            )
            if saved:  # False: another worker saved it (and counted it)
                _count_failed(entry.error[1])
            return True
        except redis.WatchError:  # its hash changed (another worker failing it?), or the connection died: again
            continue


def _count_failed(error: BaseException) -> None:
    """A failed request in the metrics, as a batch's failed job is: ``rq info`` counted it, the metrics did not."""
    prometheus.current().on_settled([], [str(error)])


def fail_listed(worker: BaseWorker, queue: Queue) -> None:
    """Fail every unreadable job in ``queue``'s intermediate list, before RQ's cleanup of it (which raises on one)."""
    ids = [i.decode() for i in worker.connection.lrange(queue.intermediate_queue_key, 0, -1)]
    if not ids:
        return
    for job_id, raw in zip(ids, job_hashes(worker, ids)):
        if raw:  # one with no hash RQ's cleanup removes by itself
            fail_if_unreadable(worker, job_id, queue, raw, listed=True)


def fail_abandoned(worker: BaseWorker, queue: Queue) -> None:
    """Fail every abandoned job of ``queue`` that RQ cannot read, before RQ's registry cleanup (which raises on one):
    the entries of its started registry that cleanup takes, those whose execution has expired."""
    registry = queue.started_job_registry
    members = [m.decode() for m in worker.connection.zrangebyscore(registry.key, 0, current_timestamp())]
    if not members:
        return
    ids = [registry.parse_job_id(m) for m in members]
    for member, job_id, raw in zip(members, ids, job_hashes(worker, ids)):
        if raw:  # one with no hash RQ's cleanup skips
            fail_if_unreadable(worker, job_id, queue, raw, listed=False, started=member)


def _abandoned(started: str | None) -> dict:
    return {"abandoned": True} if started else {}


def _fail_not_a_hash(worker: BaseWorker, job: Job, queue: Queue, *, listed: bool, started: str | None) -> None:
    """Fail ``job``, whose key is not a hash (see the module doc), unless it is no longer where it was met (another
    worker failed it: before, False here made the dequeue raise RQ's error again, and the worker quit)."""
    key_type = worker.until_written(lambda: worker.connection.type(job.key), op="rq_fail").decode()
    log.error("rq_job_unreadable", job_id=job.id, queue=queue.name, key_type=key_type, **_abandoned(started))
    job.origin = queue.name
    error = InvalidJob(
        f"RQ cannot read this job: its key {job.key} is a {key_type}, not a hash (WRONGTYPE). "
        f"{_ran(bool(started))}; its key was left as it is."
    )
    exc_string, landing = format_exc_info((InvalidJob, error, None)), Landing(worker)
    while True:
        try:
            saved = worker.until_written(
                lambda: _record_not_a_hash(worker, job, queue, exc_string, landing, listed, started), op="rq_fail"
            )
            if saved:  # False: gone from where it was met (another worker failed it)
                _count_failed(error)
            return
        except redis.WatchError:  # where it was met changed (another worker failing it?): look again
            continue


def _record_not_a_hash(
    worker: BaseWorker, job: Job, queue: Queue, exc_string: str, landing: Landing, listed: bool, started: str | None
) -> bool:
    """What ``failure.record_failure`` writes, less what goes into the job's key, in one MULTI/EXEC under WATCH of
    where the job was met; False, nothing written, if it is gone from there."""
    if landing.settle():
        return True
    where = queue.started_job_registry.key if started else queue.intermediate_queue_key if listed else None
    with worker.connection.pipeline() as pipe:
        landing.watch(pipe, *([where] if where else []))
        gone = started and pipe.zscore(where, started) is None or listed and pipe.lpos(where, job.id) is None
        if landing.settle(pipe):  # read last: an earlier try (whose reply was lost) that moved it is seen
            return True
        if gone:
            return False
        pipe.multi()
        pipe.zadd(queue.failed_job_registry.key, {job.id: current_timestamp() + DEFAULT_FAILURE_TTL})
        Result.create_failure(job, DEFAULT_FAILURE_TTL, exc_string, worker_name=worker.name, pipeline=pipe)
        worker.increment_failed_job_count(pipe)
        unlist(pipe, queue, job.id)
        if started:
            Execution.from_composite_key(started, worker.connection).delete(job=job, pipeline=pipe)
        landing.execute(pipe)
    return True
