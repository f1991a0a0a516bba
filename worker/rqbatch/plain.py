"""``worker.rq_jobs.classify`` as a plain ``rq worker`` runs it: one ticket per job, the model loaded once per process.

The batch worker never calls this: it runs the same checks (``payload``) and the same
engine on many jobs at once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from worker.rqbatch.payload import job_result, latency_ms, rq_stream_id, ticket_arg, ticket_text


@functools.lru_cache(maxsize=1)
def engine():
    """Settings + classifier, built on first use and kept for the life of the process."""
    from worker.assemble import build_classifier
    from worker.settings import Settings

    settings = Settings()
    return settings, build_classifier(settings)


def classify_one(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Classify the one ticket of ``classify(*args, **kwargs)``; mirrors the result to the results stream when run
    by RQ."""
    from rq import get_current_job

    from worker.engine.types import InvalidTicket
    from worker.stream.records import result_fields

    ticket_arg(args, kwargs)  # arguments that cannot be a ticket fail before the model loads
    settings, clf = engine()
    text = ticket_text(args, kwargs, settings.max_text_bytes)
    item = clf.prepare([text])[0]
    if isinstance(item, InvalidTicket):
        raise item
    pred = clf.classify([item])[0][0]
    job = get_current_job()
    if job is not None:
        fields = result_fields(
            job.id,
            pred,
            latency_ms=latency_ms(job),
            model=clf.model_name,
            worker=job.worker_name or "",
            stream_id=rq_stream_id(job.id),
        )
        job.connection.xadd(settings.results_stream, fields, maxlen=settings.results_maxlen, approximate=True)
    return job_result(pred, clf.model_name)
