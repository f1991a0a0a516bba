"""Enqueue tickets for triage with RQ's own API: JSON payloads, the documented job path.

Thin on purpose: each helper is one RQ call an RQ user could write by hand
(``Queue.enqueue`` / ``Queue.enqueue_many``). Jobs come back as plain ``rq.job.Job``;
read labels with ``job.return_value()`` or ``job.latest_result(timeout=...)``.
Ticket contents are checked by the worker, which fails a bad job with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from worker.rq_jobs import CLASSIFY_PATH

DEFAULT_QUEUE = "triage"
Ticket = str | Mapping[str, Any]


def triage_queue(connection: Redis, name: str = DEFAULT_QUEUE, **queue_kwargs: Any) -> Queue:
    """An RQ queue that writes JSON payloads (the only kind the triage batch worker reads)."""
    return Queue(name, connection=connection, serializer=JSONSerializer, **queue_kwargs)


def enqueue_ticket(queue: Queue, ticket: Ticket, **enqueue_kwargs: Any) -> Job:
    """One ticket (a str or ``{"text": ...}``) as one job; RQ options (retry=, job_id=, meta=, ...) pass through."""
    _require_json(queue)
    return queue.enqueue(CLASSIFY_PATH, _payload(ticket), **enqueue_kwargs)


def enqueue_tickets(
    queue: Queue,
    tickets: Iterable[Ticket],
    *,
    job_ids: Sequence[str] | None = None,
    pipeline=None,
    **job_options: Any,
) -> list[Job]:
    """Many tickets in one round trip (``Queue.enqueue_many``); ``job_options`` are ``Queue.prepare_data`` options
    (retry=, result_ttl=, timeout=, meta=, ...), the same for every job."""
    _require_json(queue)
    payloads = [_payload(t) for t in tickets]
    if job_ids is not None and len(job_ids) != len(payloads):
        raise ValueError(f"got {len(job_ids)} job ids for {len(payloads)} tickets")
    datas = [
        Queue.prepare_data(CLASSIFY_PATH, args=(p,), job_id=job_ids[i] if job_ids is not None else None, **job_options)
        for i, p in enumerate(payloads)
    ]
    return queue.enqueue_many(datas, pipeline=pipeline)


def _payload(ticket: Ticket) -> dict[str, Any]:
    if isinstance(ticket, str):
        return {"text": ticket}
    if isinstance(ticket, Mapping):
        return dict(ticket)
    raise TypeError(f"a ticket is a str or a mapping with a 'text' field, got {type(ticket).__name__}")


def _require_json(queue: Queue) -> None:
    if queue.serializer is not JSONSerializer:
        raise ValueError(
            "triage RQ jobs must be JSON: build the queue with triage_queue() or serializer=JSONSerializer"
        )
