"""The documented RQ job path ``worker.rq_jobs.classify`` (the wire contract); the code lives in ``worker.rqbatch``.

``classify`` is defined here, not re-exported, so that ``q.enqueue(classify, ...)``
still records this path. Heavy imports (torch, the engine) wait for the first job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.rqbatch.payload import CLASSIFY_PATH, InvalidJob, job_result, latency_ms, rq_stream_id, ticket_text

__all__ = ["CLASSIFY_PATH", "InvalidJob", "classify", "job_result", "latency_ms", "rq_stream_id", "ticket_text"]


def classify(ticket: Mapping[str, Any] | str) -> dict[str, Any]:
    """Classify one ticket (the plain-RQ path); mirrors the result to the results stream when run by RQ."""
    from worker.rqbatch.plain import classify_one

    return classify_one(ticket)
