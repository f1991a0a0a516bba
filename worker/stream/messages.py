"""Raw stream entry -> ``Ticket`` or ``Rejected`` (a sentence saying why). Pure: no Redis.

Entries arrive as undecoded bytes (the client reads with ``decode_responses=False``)
so that one producer's bad bytes become one dead letter with a readable reason
instead of an exception that stops the worker. Never raises on any input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.engine.types import unicode_problem

KNOWN_FIELDS = ("text", "id", "subject", "meta")
MAX_ID_BYTES = 256  # the id becomes part of a Redis key name


@dataclass(frozen=True)
class Ticket:
    stream_id: str
    ticket_id: str
    text: str  # subject (if any) + blank line + text: what the model reads
    meta: str | None  # the producer's JSON, echoed back byte for byte (decoded)


@dataclass(frozen=True)
class Rejected:
    stream_id: str
    ticket_id: str | None
    reason: str


def as_text(value: Any) -> str:
    """Stream ids and field names from redis-py (bytes or str) as ``str``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    return str(value)


class EntryFields(dict):
    """An entry's fields by name, as redis-py reads them (a name given twice: its last value), with the raw pairs
    in stream order (``pairs``): a ticket whose ``text`` came twice must not be classified on one of them, and its
    dead letter's size and hash are the entry's own."""

    def __init__(self, flat: Sequence[Any]):
        self.pairs = list(zip(flat[0::2], flat[1::2]))
        super().__init__(self.pairs)

    def repeated(self) -> list[str]:
        """Names of the known fields given more than once, in order."""
        seen, twice = set(), []
        for k, _ in self.pairs:
            name = as_text(k)
            if name in seen and name in KNOWN_FIELDS and name not in twice:
                twice.append(name)
            seen.add(name)
        return twice


DELETED_REASON = "the entry has no fields (it was probably deleted from the stream with XDEL or XTRIM)"

ENTRY_SLACK_BYTES = 4096  # beyond text + subject and meta at their limit: the id, field names, small fields


def entry_max_bytes(max_text_bytes: int) -> int:
    """The largest entry the worker reads whole (field names + values): text + subject and meta each at
    TRIAGE_MAX_TEXT_BYTES, plus ``ENTRY_SLACK_BYTES``. A larger one can be a valid ticket only through fields the
    worker ignores; it is dead-lettered from what Redis measured of it (``Unread``), never read (read_scripts.py)."""
    return 2 * max_text_bytes + ENTRY_SLACK_BYTES


@dataclass(frozen=True)
class Unread:
    """An entry too large to read: what the read script measured of it in Redis, instead of its fields."""

    size: int  # bytes of its field names and values
    n_fields: int
    fields: tuple[tuple[bytes, int, bytes], ...]  # its first 32: name (first 64 bytes), value size, value's first bytes
    limit: int  # the entry_max_bytes it was over
    max_text_bytes: int

    def ticket_id(self, stream_id: str) -> str | None:
        """The ticket id ``parse_entry`` gives (so a waiter on it learns the outcome): its ``id`` field when that came
        whole and is valid, the stream id when it has none; None when it cannot be told (an id cut, invalid or given
        twice, or fields past the 32 measured)."""
        ids = [(n, v) for name, n, v in self.fields if name == b"id"]
        if not ids:
            return stream_id if self.n_fields == len(self.fields) else None
        if len(ids) != 1 or ids[0][0] != len(ids[0][1]):
            return None
        got = _decode(ids[0][1], "id")
        return None if isinstance(got, Rejected) or id_problem(got) else got

    def reason(self) -> str:
        """The dead letter's reason: a known field given twice (parse_entry's words) or the field over its limit when
        there is one (what the producer must fix), and that the entry was not read, which is why the dead letter has
        no hash."""
        sizes: dict[bytes, int] = {}
        twice: list[str] = []
        for name, n, _ in self.fields:
            known = as_text(name)
            if name in sizes and known in KNOWN_FIELDS and known not in twice:
                twice.append(known)  # parse_entry's reason: no one of them need be as large as their sum
            sizes[name] = sizes.get(name, 0) + n
        text, meta, m = sizes.get(b"text", 0) + sizes.get(b"subject", 0), sizes.get(b"meta", 0), self.max_text_bytes
        if twice:
            head = "the entry gives " + " and ".join(f"'{n}'" for n in twice) + " more than once"
        elif b"text" in sizes and text > m:
            what = "text" if b"subject" not in sizes else "subject + text"
            head = f"{what} is {text} bytes, over the limit of {m} bytes (TRIAGE_MAX_TEXT_BYTES)"
        elif meta > m:
            head = f"meta is {meta} bytes, over the limit of {m} bytes (TRIAGE_MAX_TEXT_BYTES)"
        else:
            head = (
                f"the entry is over the {self.limit} bytes a ticket can take "
                f"(2 x TRIAGE_MAX_TEXT_BYTES + {ENTRY_SLACK_BYTES} for the id and other fields)"
            )
        return (
            f"{head}; the entry ({self.size} bytes) was too large to read, so this dead letter has its size and "
            "the first bytes of its fields, no SHA-256"
        )


def parse_entry(stream_id: Any, fields: Mapping[Any, Any] | None, *, max_text_bytes: int) -> Ticket | Rejected:
    """Validate one entry's flat fields. Unknown fields are ignored (they stay in the dead-letter payload)."""
    sid = as_text(stream_id)
    if not fields:
        return Rejected(sid, None, DELETED_REASON)
    named: dict[str, Any] = {}
    for k, v in fields.items():
        name = k.decode("utf-8", errors="replace") if isinstance(k, bytes) else k if isinstance(k, str) else None
        if name in KNOWN_FIELDS:
            named[name] = v

    ticket_id: str | None = sid
    if "id" in named:
        got = _decode(named["id"], "id")
        if isinstance(got, Rejected):
            return Rejected(sid, None, got.reason)
        ticket_id = got
        why = id_problem(ticket_id)
        if why:
            return Rejected(sid, None, why)
    twice = fields.repeated() if isinstance(fields, EntryFields) else []
    if twice:  # redis-py keeps a name's last value: the ticket would be classified on part of what was sent
        names = " and ".join(f"'{n}'" for n in twice)
        return Rejected(sid, None if "id" in twice else ticket_id, f"the entry gives {names} more than once")

    if "text" not in named:
        return Rejected(
            sid, ticket_id, "the entry has no 'text' field; every ticket needs one (XADD <stream> * text \"...\")"
        )
    text_size = _size(named["text"])
    subject_size = _size(named.get("subject", b""))
    if text_size + subject_size > max_text_bytes:
        what = "text" if "subject" not in named else "subject + text"
        return Rejected(
            sid,
            ticket_id,
            f"{what} is {text_size + subject_size} bytes, "
            f"over the limit of {max_text_bytes} bytes (TRIAGE_MAX_TEXT_BYTES)",
        )
    text = _decode(named["text"], "text")
    if isinstance(text, Rejected):
        return Rejected(sid, ticket_id, text.reason)
    if not text.strip():
        return Rejected(sid, ticket_id, "text is empty (or only whitespace); there is nothing to classify")

    if "subject" in named:
        subject = _decode(named["subject"], "subject")
        if isinstance(subject, Rejected):
            return Rejected(sid, ticket_id, subject.reason)
        text = with_subject(subject, text)

    meta: str | None = None
    if "meta" in named:
        if _size(named["meta"]) > max_text_bytes:
            return Rejected(
                sid,
                ticket_id,
                f"meta is {_size(named['meta'])} bytes, "
                f"over the limit of {max_text_bytes} bytes (TRIAGE_MAX_TEXT_BYTES)",
            )
        got = _decode(named["meta"], "meta")
        if isinstance(got, Rejected):
            return Rejected(sid, ticket_id, got.reason)
        why = meta_problem(got)
        if why:
            return Rejected(sid, ticket_id, why)
        meta = got
    return Ticket(sid, ticket_id or sid, text, meta)


def _size(v: Any) -> int:
    if isinstance(v, (bytes, bytearray)):
        return len(v)
    if isinstance(v, str):
        return len(v.encode("utf-8", errors="surrogatepass"))
    return len(str(v))


def _decode(v: Any, name: str) -> str | Rejected:
    """Strict UTF-8: a producer sending Latin-1 or binary gets told so, with the offending byte."""
    if isinstance(v, str):
        why = unicode_problem(v, name)
        return v if why is None else Rejected("", None, why)
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as e:
            bad = bytes(v)[e.start : e.start + 1].hex()
            return Rejected(
                "", None, f"{name} is not valid UTF-8 (byte 0x{bad} at position {e.start}); send UTF-8 encoded text"
            )
    if isinstance(v, (int, float)):  # only from in-process callers; Redis hands back bytes
        return str(v)
    return Rejected("", None, f"{name} must be a string, got {type(v).__name__}")


def with_subject(subject: str, text: str) -> str:
    """What the model reads of a ticket with a subject: the subject, a blank line, the text (a blank subject: the
    text). The stream worker and the RQ path both read a ``subject`` this way."""
    return f"{subject.strip()}\n\n{text}" if subject.strip() else text


def id_problem(ticket_id: str) -> str | None:
    """Why the worker dead-letters this ticket id (None: fine); the producer client refuses such ids before sending,
    as their dead letters carry no id to wait on."""
    if not ticket_id.strip():
        return "id is empty; omit the 'id' field to use the stream entry id instead"
    if len(ticket_id.encode("utf-8")) > MAX_ID_BYTES:
        return f"id is longer than {MAX_ID_BYTES} bytes"
    bad = _CONTROL.search(ticket_id)
    if bad:
        return (
            f"id contains control characters (U+{ord(bad.group()):04X} at position {bad.start()}; newline, tab, NUL, "
            "DEL and U+0080-U+009F are not allowed)"
        )
    return None


# C0 (U+0000-U+001F), DEL and C1 (U+0080-U+009F: e.g. U+0085 next line, U+009B CSI, which terminals obey);
# one regex scan, not a Python loop per character of every ticket id
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def meta_problem(meta: str) -> str | None:
    """Why ``meta`` is no strict JSON object (None: it is one). Strict: no NaN or Infinity (Python's parser takes
    them, JSON has none, and a reader of the results would fail on them) and no lone surrogate escape ("\\ud800",
    which no UTF-8 output can print). The worker dead-letters such a ticket with this reason."""
    try:
        value = _STRICT_JSON.decode(meta)
    except RecursionError:  # valid or not, the parser gave up on the depth before it could tell
        return (
            "meta is nested too deeply to read (arrays/objects inside each other beyond the parser's limit); "
            "send a flatter JSON object"
        )
    except ValueError as e:
        detail = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        return f'meta is not valid JSON ({detail}); send a JSON object such as {{"customer": 42}} or omit it'
    if not isinstance(value, dict):
        return f"meta must be a JSON object, got a JSON {_json_kind(value)}"
    if _SURROGATE_ESCAPE.search(meta):  # a pair (an emoji) is fine: only a lone half cannot be UTF-8
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return (
                "meta is not valid JSON for a UTF-8 reader (a lone surrogate escape such as \\ud800, half of an "
                "emoji); send valid Unicode"
            )
    return None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value")


_STRICT_JSON = json.JSONDecoder(parse_constant=_not_json)  # built once: meta is parsed for every ticket with one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
