"""The wire format of results and dead-letter records (flat string fields). Pure: no Redis.

Shared by the stream worker and the RQ integration so both write identical records.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from worker.engine.types import Prediction


def stream_id_ms(stream_id: str | bytes) -> int:
    """Milliseconds part of a Redis stream entry id (when it was enqueued)."""
    if isinstance(stream_id, bytes):
        stream_id = stream_id.decode()
    return int(stream_id.split("-", 1)[0])


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
        "scores": json.dumps({k: round(v, 6) for k, v in pred.scores.items()}),
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


def dead_letter_fields(
    *,
    stream_id: str,
    reason: str,
    payload: Mapping[Any, Any],
    deliveries: int,
    ticket_id: str | None = None,
    worker: str = "",
) -> dict[str, str]:
    fields = {
        "stream_id": stream_id,
        "reason": reason,
        "payload": json.dumps({_text(k): _text(v) for k, v in payload.items()}, ensure_ascii=False),
        "deliveries": str(deliveries),
        "worker": worker,
        "dead_at_ms": str(int(time.time() * 1000)),
    }
    if ticket_id is not None:
        fields["id"] = ticket_id
    return fields


def _text(v: Any) -> str:
    """Bytes as text for JSON; undecodable bytes are kept visible as escapes, never dropped."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="backslashreplace")
    return str(v)
