"""What the batch worker accepts from an RQ job, decided before anything of the job runs.

A batch worker only runs ``worker.rq_jobs.classify``. Every name in a job that RQ
would import and call (the function, on_success/on_failure/on_stopped callbacks) is
checked as a plain string first, so a job can never make this process import or
run anything else. The payload itself is only ever read with JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.queue import Queue

from worker.rqbatch.payload import CLASSIFY_PATH, InvalidJob, ticket_text

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]

# RQ keeps the callback names as strings on the job and imports them on first
# access of job.success_callback etc.; reading the strings imports nothing.
_CALLBACK_ATTRS = {
    "on_success": "_success_callback_name",
    "on_failure": "_failure_callback_name",
    "on_stopped": "_stopped_callback_name",
}


@dataclass(eq=False)  # entries are compared by identity
class Entry:
    """One RQ job of a batch and what happened to it."""

    job: Job
    queue: Queue
    execution: Any = None  # rq.executions.Execution once started
    text: str | None = None
    item: Any = None  # engine Prepared
    result: dict | None = None  # the job's return value
    pred: Any = None  # engine Prediction, for the results stream
    error: ExcInfo | None = None
    callbacks_ok: bool = False  # only then may its success/failure callback run
    recorded: bool = False  # finished or failed in RQ's registries: no more heartbeats for its execution
    mirrored: bool = False  # its label is in the results stream
    repeats: tuple | None = None  # (repeats_left, repeat_intervals) before the first try to record its success
    dropped: str | None = None  # not started: its status when its batch started ("canceled", ...) or "deleted"

    def fail(self, exc: BaseException) -> None:
        self.error = (type(exc), exc, exc.__traceback__)


def unlist(pipe, queue, job_id: str, count: int = 0) -> None:
    """Into ``pipe``: the job off its queue's intermediate list, with RQ's first sighting of it there (kept, a job
    listed again later was failed as "stuck" at once by RQ's cleanup). ``count``: LREM's (0: every copy)."""
    pipe.lrem(queue.intermediate_queue_key, count, job_id)
    pipe.delete(queue.intermediate_queue.get_first_seen_key(job_id))


def unlist_now(connection, queue, job_id: str, count: int = 0) -> None:
    """``unlist`` on its own (a job that leaves the list without a transaction around it: gone, or already done)."""
    with connection.pipeline() as pipe:
        unlist(pipe, queue, job_id, count)
        pipe.execute()


def job_hashes(worker, job_ids: list[str]) -> list[dict | redis.ResponseError]:
    """The raw hashes (HGETALL) of ``job_ids``, in one round trip; {} for a job that is gone, the error for a job key
    that is not a hash (``not_a_hash``: raised, one such job made every read of its batch raise)."""
    with worker.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(worker.job_class.key_for(job_id))
        replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and not not_a_hash(reply):
            raise reply
    return replies


def not_a_hash(reply: object) -> bool:
    """Whether ``reply`` is Redis' answer to HGETALL on a key of another type."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def parse_allowed(spec: str | None) -> frozenset[str]:
    """``TRIAGE_RQ_ALLOWED_CALLBACKS`` ("a.b.f, c.d.g") as a set of dotted paths."""
    return frozenset(x.strip() for x in (spec or "").split(",") if x.strip())


def callback_names(job: Job) -> dict[str, str]:
    """The job's callback paths by kind ("on_failure": "pkg.mod.func"), without importing them."""
    names = {kind: getattr(job, attr) for kind, attr in _CALLBACK_ATTRS.items()}  # no default: fail closed
    return {kind: name for kind, name in names.items() if isinstance(name, str) and name}


def check_job(entry: Entry, max_text_bytes: int, allowed_callbacks: frozenset[str]) -> None:
    """Fill ``entry.text`` or ``entry.error``; decide whether its callbacks may run."""
    job = entry.job
    try:
        try:
            func = job.func_name
            instance, args, kwargs = job.instance, job.args, job.kwargs
        except DeserializationError:
            raise InvalidJob(
                "job payload is not JSON: enqueue with serializer=rq.serializers.JSONSerializer "
                "(pickle payloads are never loaded)"
            ) from None
        if func != CLASSIFY_PATH:
            raise InvalidJob(f"the triage batch worker only runs {CLASSIFY_PATH}; refused to run {func!r}")
        if instance is not None:
            raise InvalidJob(f"{CLASSIFY_PATH} is a plain function, not a method of an instance")
        refused = sorted(
            f"{kind}={name}" for kind, name in callback_names(job).items() if name not in allowed_callbacks
        )
        if refused:
            raise InvalidJob(
                f"callback(s) not allowed: {', '.join(refused)} (list them in TRIAGE_RQ_ALLOWED_CALLBACKS to allow)"
            )
        entry.callbacks_ok = True
        entry.text = ticket_text(args, kwargs, max_text_bytes)
    except InvalidJob as e:
        entry.fail(e)
    except Exception as e:  # noqa: BLE001 - whatever else a hand-written job hash breaks: its job fails, not the batch
        entry.fail(InvalidJob(f"cannot read this job: {type(e).__name__}: {e}"))


MAX_ALARM_S = 2**31 - 1  # the most signal.alarm takes (a C int): more raised OverflowError for the whole batch


def batch_timeout_s(jobs: list[Job], default_s: int) -> int:
    """One timeout for a whole batch: its jobs' timeouts added up, the time RQ would give them one
    after another (-1, no limit, if one job has none: -1 or any other value <= 0, which RQ's alarm never sets; a
    job's -358 made its batch's limit 2 s). Over it, every job of the batch fails."""
    timeouts = [int(job.timeout or default_s) for job in jobs]
    if any(t <= 0 for t in timeouts):
        return -1
    return min(sum(timeouts), MAX_ALARM_S)
