"""The documented RQ job path ``worker.rq_jobs.classify`` (the wire contract); the code lives in ``worker.rqbatch``.

``classify`` is defined here, not re-exported, so that ``q.enqueue(classify, ...)``
still records this path. Heavy imports (torch, the engine) wait for the first job.
"""

from __future__ import annotations

from typing import Any

from worker.rqbatch.payload import CLASSIFY_PATH, InvalidJob, job_result, latency_ms, rq_stream_id, ticket_text

__all__ = ["CLASSIFY_PATH", "InvalidJob", "classify", "job_result", "latency_ms", "rq_stream_id", "ticket_text"]


def classify(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``classify(ticket)``: classify one ticket (``{"text": ...}`` or a str, positional or ``ticket=``) on the
    plain-RQ path; mirrors the result to the results stream when run by RQ.

    The arguments are read by ``payload.ticket_arg``, the batch worker's own rule, not by Python's binding: a job
    with another keyword fails with the same reason on either worker."""
    from worker.rqbatch.plain import classify_one

    return classify_one(args, kwargs)
