"""The payload rules every RQ path shares: what a classify job may carry, and what it returns.

RQ users enqueue ``CLASSIFY_PATH`` (``q.enqueue("worker.rq_jobs.classify", {"text": ...})``, or ``ticket=...``)
and read the label from ``job.return_value()``. The batch worker (``BatchWorker``)
recognises the path and runs these checks and the engine on many jobs at once; a plain
``rq worker`` runs the function itself (``worker.rqbatch.plain``). Pure: no torch, no Redis.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from worker.stream.messages import unicode_problem, with_subject

CLASSIFY_PATH = "worker.rq_jobs.classify"  # the wire contract: job payloads name this path


class InvalidJob(ValueError):
    """A job triage refuses or cannot read; the message is a sentence for a person (it lands in exc_info)."""


def ticket_arg(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The one ticket of ``classify(ticket)``, passed as Python would bind it: positional, or the keyword ``ticket``.

    Both RQ paths use this rule (a plain ``rq worker`` too, through ``rq_jobs.classify``), so a job runs, or fails
    for the same reason, whichever worker takes it. Raises ``InvalidJob`` for any other keyword or count, and for
    args that are no list or kwargs no object (a job hash written by hand: ``null`` args stopped the batch worker)."""
    if not isinstance(args, (list, tuple)):
        raise InvalidJob(f"the job's args must be an array, got {_json_type(args)}")
    if not isinstance(kwargs, Mapping):
        raise InvalidJob(f"the job's kwargs must be an object, got {_json_type(kwargs)}")
    extra = sorted(str(k) for k in kwargs if k != "ticket")
    if extra:
        raise InvalidJob(
            f"classify takes one ticket (positional, or ticket=...); unexpected keyword argument(s): {', '.join(extra)}"
        )
    given = [*args, kwargs["ticket"]] if "ticket" in kwargs else list(args)
    if len(given) != 1:
        raise InvalidJob(f"classify takes exactly one ticket argument, got {len(given)}")
    return given[0]


def ticket_text(args: Sequence[Any], kwargs: Mapping[str, Any], max_text_bytes: int) -> str:
    """What the model reads of a classify call ``classify(ticket)``; ``ticket`` is ``{"text": str}`` (a
    ``"subject"`` too, read as the stream worker reads one: ``messages.with_subject``) or a str.

    Other keys in the dict are ignored (RQ's own ``meta=`` carries what a caller wants back with the job). Raises
    ``InvalidJob`` with a clear reason otherwise.
    """
    ticket = ticket_arg(args, kwargs)
    subject = None
    if isinstance(ticket, Mapping):
        if "text" not in ticket:
            raise InvalidJob('ticket has no \'text\' field (expected {"text": "..."})')
        text, subject = ticket["text"], ticket.get("subject")
    elif isinstance(ticket, str):
        text = ticket
    else:
        raise InvalidJob(f"ticket must be an object with a 'text' field or a string, got {_json_type(ticket)}")
    for name, value in (("text", text), ("subject", subject)):
        if name == "subject" and value is None:
            continue
        if not isinstance(value, str):
            raise InvalidJob(f"ticket {name} must be a string, got {_json_type(value)}")
        why = unicode_problem(value, f"ticket {name}")  # else one such job would fail its whole batch in the tokenizer
        if why:
            raise InvalidJob(why)
    if not text.strip():
        raise InvalidJob("ticket text is empty")
    n_bytes = sum(len(v.encode("utf-8", errors="surrogatepass")) for v in (text, subject) if v is not None)
    if n_bytes > max_text_bytes:
        what = "text" if subject is None else "subject + text"
        raise InvalidJob(
            f"ticket {what} is {n_bytes} bytes, over the {max_text_bytes}-byte limit (TRIAGE_MAX_TEXT_BYTES)"
        )
    return text if subject is None else with_subject(subject, text)


def job_result(pred, model: str) -> dict[str, Any]:
    """What ``job.return_value()`` gives an RQ user: plain JSON, no engine types."""
    return {
        "label": pred.label,
        "score": round(pred.score, 6),
        "scores": {k: round(v, 6) for k, v in pred.scores.items()},
        "truncated": pred.truncated,
        "tokens": pred.n_tokens,
        "model": model,
    }


def rq_stream_id(job_id: str) -> str:
    """The results stream's de-duplication key (``stream_id``) for an RQ job: ``rq:<job id>``.

    Stream-worker results carry the input entry id there; an RQ job has no entry, and a
    job re-run after a crash keeps its id, so its id is what identifies "the same ticket"."""
    return f"rq:{job_id}"


def latency_ms(job) -> float | None:
    """Enqueue-to-label time of an RQ job, for the results stream."""
    if job is None or job.enqueued_at is None:
        return None
    return max(0.0, (time.time() - job.enqueued_at.timestamp()) * 1000)


def _json_type(value: Any) -> str:
    names = {
        dict: "object",
        list: "array",
        str: "string",
        int: "number",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
