"""What goes on the wire for one ticket, checked before anything is sent.

Why here and not only in the worker: a ticket the worker dead-letters without an id (a bad id) cannot be waited
on, and a field redis-py cannot encode fails a send part-way; the rules are the worker's own
(``worker.stream.messages``), so the two never disagree.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.stream.messages import id_problem, unicode_problem

if TYPE_CHECKING:
    from producer.client import Submitted


class InvalidTicket(ValueError, TypeError):
    """A ticket the worker would dead-letter without an id to wait on, or that cannot be sent at all (``index``: its
    position in the call). ``submitted``: what the call had sent before it (nothing when given a list: a list is
    checked whole before the first chunk goes). A TypeError too: a text that is no str raised one before."""

    def __init__(self, index: int, reason: str, submitted: list[Submitted] | None = None):
        super().__init__(f"ticket {index}: {reason}")
        self.index, self.reason = index, reason
        self.submitted = submitted or []


def ticket_fields(text: str, *, ticket_id: str, subject: str | None = None, meta: Any = None) -> dict[str, str]:
    """The flat fields of one input entry (``meta``: a dict is JSON-encoded, a string is sent as is).

    Raises ``TypeError`` / ``ValueError`` for what the worker would reject without an id (an id over 256 bytes,
    blank, with control characters), for what Redis cannot carry (text that is not valid Unicode) and for a dict
    ``meta`` that is no JSON (NaN, Infinity): better here than a dead letter that ``wait`` cannot match. A string
    ``meta`` goes as it is; the worker dead-letters one that is no strict JSON object, with the reason."""
    if not isinstance(text, str):
        raise TypeError(f"ticket text must be a str, got {type(text).__name__}")
    if not isinstance(ticket_id, str):
        raise TypeError(f"ticket id must be a str, got {type(ticket_id).__name__}")
    why = id_problem(ticket_id)
    if why:
        raise ValueError(f"ticket id {ticket_id!r:.80}: {why}")
    fields = {"text": text, "id": ticket_id}
    if subject is not None:
        fields["subject"] = _scalar(subject, "subject")
    if meta is not None:
        if not isinstance(meta, (str, dict)):
            raise TypeError(f"meta must be a dict (sent as a JSON object) or a JSON string, got {type(meta).__name__}")
        try:
            fields["meta"] = meta if isinstance(meta, str) else json.dumps(meta, ensure_ascii=False, allow_nan=False)
        except ValueError as e:  # NaN / Infinity: no JSON value
            raise ValueError(f"meta is not valid JSON ({e}); send finite numbers") from None
    for name, value in fields.items():  # redis-py would raise while packing the chunk, after earlier chunks went
        why = unicode_problem(value, name)
        if why:
            raise ValueError(why)
    return fields


def normalize_at(index: int, ticket: Any, sent: list[Submitted]) -> tuple[str, dict[str, str]]:
    """``normalize``, its failure as ``InvalidTicket`` at ``index`` (with what the call had ``sent``)."""
    try:
        return normalize(ticket)
    except (TypeError, ValueError) as e:
        raise InvalidTicket(index, str(e), list(sent)) from None


def normalize(ticket: str | Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """A plain string or a mapping with text / id / subject / meta (other keys are ignored); an id or subject is a
    string or a finite number (sent as its text)."""
    if isinstance(ticket, str):
        ticket = {"text": ticket}
    if "text" not in ticket:
        raise ValueError(f"ticket has no 'text': {dict(ticket)!r:.200}")
    given = ticket.get("id")
    tid = _scalar(given, "id") if given not in (None, "") else uuid.uuid4().hex
    subject = _scalar(ticket.get("subject"), "subject") or None
    meta = ticket.get("meta")
    return tid, ticket_fields(
        ticket["text"], ticket_id=tid, subject=subject, meta=meta if meta not in ("", None) else None
    )


_KIND = {dict: "a dict (a JSON object)", list: "a list (a JSON array)", bool: "a boolean"}


def _scalar(value: Any, name: str) -> Any:
    """A string, or a finite number as its text (``7`` -> "7"); ``TypeError`` for anything else: ``str()`` made an
    object id of a JSON Lines file the id "{'a': 1}", which the caller never sent and cannot wait on."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value):
            return str(value)
        raise TypeError(f"{name} must be a string or a finite number, got {value!r}")
    kind = _KIND.get(type(value)) or f"a {type(value).__name__}"
    raise TypeError(f"{name} must be a string or a number, got {kind}: {value!r:.60}")
