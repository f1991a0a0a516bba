"""The wire format of results and dead-letter records (flat string fields). Pure: no Redis.

Shared by the stream worker and the RQ integration so both write identical records.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from worker.engine.types import Prediction
from worker.stream.messages import Unread


def stream_id_ms(stream_id: str | bytes) -> int:
    """Milliseconds part of a Redis stream entry id (when it was enqueued)."""
    if isinstance(stream_id, bytes):
        stream_id = stream_id.decode()
    return int(stream_id.split("-", 1)[0])


def stamp_latency(results: Sequence[dict[str, str]], now_ms: float | None = None) -> None:
    """Each result's ``latency_ms`` to now (enqueue -> this write try), in place: set where the records were built,
    a write held up by an outage or a queue of passes said up to seconds less than it took."""
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    for rec in results:
        sid = rec.get("stream_id")
        if sid is not None and "latency_ms" in rec:
            rec["latency_ms"] = f"{max(0.0, now_ms - stream_id_ms(sid)):.1f}"


def result_fields(
    ticket_id: str,
    pred: Prediction,
    *,
    latency_ms: float | None,
    model: str,
    worker: str,
    meta: str | None = None,
    stream_id: str | None = None,
) -> dict[str, str]:
    fields = {
        "id": ticket_id,
        "label": pred.label,
        "score": f"{pred.score:.6f}",
        "scores": scores_json(pred.scores),
        "truncated": "1" if pred.truncated else "0",
        "tokens": str(pred.n_tokens),
        "model": model,
        "worker": worker,
        "classified_at_ms": str(int(time.time() * 1000)),
    }
    if latency_ms is not None:
        fields["latency_ms"] = f"{latency_ms:.1f}"
    if meta is not None:
        fields["meta"] = meta
    if stream_id is not None:
        fields["stream_id"] = stream_id
    return fields


def scores_json(scores: Mapping[str, float]) -> str:
    """``{"label": probability, ...}`` as JSON, each probability to 6 decimals (the value ``round(p, 6)`` gives).

    One C-level format per ticket through a template per label set: ``json.dumps`` of a dict of ``round``-ed
    floats was a third of a result record's cost on the pass thread (8 of 25 us on a 2-core EPYC)."""
    return _scores_template(tuple(scores)) % tuple(scores.values())


@lru_cache(maxsize=64)
def _scores_template(names: tuple[str, ...]) -> str:
    return "{" + ", ".join(json.dumps(n).replace("%", "%%") + ": %.6f" for n in names) + "}"


DEAD_LETTER_EXCERPT_BYTES = 4096  # default bound of a dead letter's payload excerpt (TRIAGE_DEAD_LETTER_EXCERPT_BYTES)
_EXCERPT_MAX_FIELDS = 32
_EXCERPT_MAX_NAME = 64


def dead_letter_fields(
    *,
    stream_id: str,
    reason: str,
    payload: Mapping[Any, Any],
    deliveries: int,
    ticket_id: str | None = None,
    worker: str = "",
    excerpt_bytes: int = DEAD_LETTER_EXCERPT_BYTES,
    unread: Unread | None = None,
) -> dict[str, str]:
    """A dead letter: the reason, and the entry's fields as a bounded excerpt with their size and hash.

    Why not the whole payload: it is stored twice (the dead-letter stream and the latest-result
    key), so a 5 MB ticket cost 6.3 MB of Redis memory as a dead letter; 128 of them took 1.3 GB.
    ``unread``: the entry was too large to read (``payload`` holds the first bytes of its fields): its size is
    the one Redis measured, and its hash is empty, as it would take the whole entry."""
    if unread is None:
        excerpt, cut = payload_excerpt(payload, excerpt_bytes)
        size, digest = payload_size(payload), payload_sha256(payload)
    else:
        excerpt, cut = payload_excerpt(payload, excerpt_bytes, n_fields=unread.n_fields)
        size, digest = unread.size, ""
    fields = {
        "stream_id": stream_id,
        "reason": reason,
        "payload": excerpt,
        "payload_truncated": "1" if cut else "0",
        "payload_bytes": str(size),
        "payload_sha256": digest,
        "deliveries": str(deliveries),
        "worker": worker,
        "dead_at_ms": str(int(time.time() * 1000)),
    }
    if ticket_id is not None:
        fields["id"] = ticket_id
    return fields


def _items(payload: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """The entry's fields as sent: every pair in stream order (a name given twice, twice: ``EntryFields``)."""
    pairs = getattr(payload, "pairs", None)
    return list(pairs) if pairs is not None else list(payload.items())


def _distinct(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Names made unique for a JSON object: a name's second value under ``name#2``."""
    seen: dict[str, int] = {}
    out = []
    for name, value in pairs:
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", value))
    return out


def payload_excerpt(payload: Mapping[Any, Any], limit_bytes: int, *, n_fields: int | None = None) -> tuple[str, bool]:
    """The fields as a JSON object of at most ``limit_bytes`` UTF-8 bytes; True if anything was cut.

    Undecodable bytes appear as ``\\xNN`` escapes. When cut: at most 32 fields (names up to 64
    characters), each value shortened to the same length and ended with "…", and a field "…"
    saying how many fields were left out. ``n_fields``: ``payload`` is already an excerpt (the first bytes
    of the first fields of an entry of that many fields): always cut."""
    pairs = _distinct([(_text(k), _text(v)) for k, v in _items(payload)])
    if n_fields is None:
        whole = json.dumps(dict(pairs), ensure_ascii=False)
        if len(whole.encode("utf-8")) <= limit_bytes:
            return whole, False
    total = len(pairs) if n_fields is None else n_fields
    cap = limit_bytes
    while cap > 0:
        cut = {
            name[:_EXCERPT_MAX_NAME]: value if len(value) <= cap else value[:cap] + "…"
            for name, value in pairs[:_EXCERPT_MAX_FIELDS]
        }
        if total > _EXCERPT_MAX_FIELDS:
            cut["…"] = f"{total - _EXCERPT_MAX_FIELDS} more fields"
        text = json.dumps(cut, ensure_ascii=False)
        if len(text.encode("utf-8")) <= limit_bytes:
            return text, True
        cap //= 2
    return json.dumps({"…": f"{total} fields, too large to excerpt"}), True


def payload_size(payload: Mapping[Any, Any]) -> int:
    """Bytes of the entry as received: field names and values."""
    return sum(len(_raw(k)) + len(_raw(v)) for k, v in _items(payload))


def payload_sha256(payload: Mapping[Any, Any]) -> str:
    """SHA-256 (hex) of the entry's raw fields in stream order, each name and value as a netstring
    (``<length>:<bytes>,``), so anyone holding the original entry can match it to its dead letter."""
    h = hashlib.sha256()
    for k, v in _items(payload):
        for part in (_raw(k), _raw(v)):
            h.update(b"%d:%s," % (len(part), part))
    return h.hexdigest()


def _raw(v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    return str(v).encode("utf-8", errors="surrogatepass")


def _text(v: Any) -> str:
    """Bytes as text for JSON; undecodable bytes are kept visible as escapes, never dropped."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="backslashreplace")
    return str(v)
