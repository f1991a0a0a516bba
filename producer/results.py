"""A ticket's outcome as the producer sees it, parsed from the worker's flat string records.

The worker writes every value as a string (``worker/stream/records.py``); this
turns them back into numbers, dicts and booleans once, in one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def as_str(v: Any) -> str:
    return v.decode("utf-8", errors="backslashreplace") if isinstance(v, bytes) else str(v)


# fields of a worker record that are numbers or 0/1 flags in the wire's strings (a flag "0" is a truthy str)
INT_FIELDS = ("tokens", "classified_at_ms", "deliveries", "dead_at_ms", "payload_bytes")
FLAG_FIELDS = ("truncated", "payload_truncated")


def decode_flat(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the worker's integer and 0/1 flag strings as ints and bools, in place (others left as they are)."""
    for k in INT_FIELDS:
        if isinstance(out.get(k), str) and out[k].lstrip("-").isdigit():
            out[k] = int(out[k])
    for k in FLAG_FIELDS:
        if out.get(k) in ("0", "1"):
            out[k] = out[k] == "1"
    return out


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Result:
    ticket_id: str
    status: str  # "ok" (classified) | "dead_letter" (rejected; see reason)
    label: str | None = None
    score: float | None = None  # probability of the label
    scores: dict[str, float] = field(default_factory=dict)
    latency_ms: float | None = None  # enqueue -> result written
    reason: str | None = None  # why a dead-lettered ticket was rejected
    result_entry_id: str | None = None  # its entry id in the stream it was read from (results or dead letters)
    fields: dict[str, str] = field(default_factory=dict)  # the raw record, every field

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_fields(
        cls, fields: Mapping[Any, Any], *, ticket_id: str | None = None, result_entry_id: str | None = None
    ) -> Result:
        f = {as_str(k): as_str(v) for k, v in fields.items()}
        try:
            scores = {k: float(v) for k, v in json.loads(f.get("scores", "{}")).items()}
        except (ValueError, AttributeError):
            scores = {}
        status = f.get("status") or ("dead_letter" if "reason" in f and "label" not in f else "ok")
        return cls(
            ticket_id=ticket_id or f.get("id", ""),
            status=status,
            label=f.get("label"),
            score=_float(f.get("score")),
            scores=scores,
            latency_ms=_float(f.get("latency_ms")),
            reason=f.get("reason"),
            result_entry_id=result_entry_id,
            fields=f,
        )

    @classmethod
    def from_json(cls, raw: str, *, ticket_id: str) -> Result:
        """The per-ticket key's value: a JSON object of the record plus ``status``."""
        try:
            data = json.loads(raw)
        except ValueError:
            return cls(ticket_id=ticket_id, status="unreadable", reason=f"result key holds non-JSON: {raw[:80]!r}")
        if not isinstance(data, dict):
            return cls(
                ticket_id=ticket_id, status="unreadable", reason=f"result key holds a JSON {type(data).__name__}"
            )
        return cls.from_fields(
            {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}, ticket_id=ticket_id
        )

    @classmethod
    def from_stream(cls, stream_id: Any, fields: Mapping[Any, Any]) -> Result:
        return cls.from_fields(fields, result_entry_id=as_str(stream_id))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the raw record (``stream_id`` = the input entry) with numbers, scores, flags and meta decoded."""
        out: dict[str, Any] = dict(self.fields)
        out["id"] = self.ticket_id
        out["status"] = self.status
        if self.result_entry_id:
            out["result_entry_id"] = self.result_entry_id
        if self.score is not None:
            out["score"] = self.score
        if self.scores:
            out["scores"] = self.scores
        if self.latency_ms is not None:
            out["latency_ms"] = self.latency_ms
        decode_flat(out)
        for k in ("meta", "payload"):
            if k in out:
                try:
                    out[k] = json.loads(out[k])
                except ValueError:
                    pass
        return out
