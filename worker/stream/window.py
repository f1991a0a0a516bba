"""A window: the entries one drain read, split into tickets to classify and entries to
dead-letter, and (after the model ran) turned into the ``Outcome`` to write.

Everything here is decided per entry, so one bad entry never affects its neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from worker.engine.isolation import prepare_isolated, short
from worker.engine.types import Prediction, Prepared
from worker.stream.messages import Rejected, Ticket, parse_entry
from worker.stream.records import DEAD_LETTER_EXCERPT_BYTES, dead_letter_fields, result_fields, stream_id_ms
from worker.stream.sink import Outcome
from worker.stream.source import RawEntry


@dataclass
class Window:
    entries: list[RawEntry]
    source: str  # new | pending | claimed
    tickets: list[Ticket] = field(default_factory=list)
    prepared: list[Prepared] = field(default_factory=list)  # aligned with tickets
    rejected: list[tuple[RawEntry, str | None, str]] = field(default_factory=list)  # (entry, ticket id, reason)
    read_ms: float = 0.0
    tokenize_ms: float = 0.0  # parse + tokenize
    backlog: int | None = None
    pending: int | None = None
    epoch: int = 0  # the consumer-group epoch it was read in (group.py): an older one means the group was lost
    cap_items: int = 0  # the most entries it could take (sizing.py)
    passes: list = field(default_factory=list)  # its planned passes (bucketing.Pass), planned by the reader

    @property
    def ids(self) -> list[str]:
        return [e.stream_id for e in self.entries]

    @cached_property
    def by_id(self) -> dict[str, RawEntry]:
        """Entries by stream id, built once per window (on its first dead letter), not once per pass."""
        return {e.stream_id: e for e in self.entries}


def poison_reason(deliveries: int, max_deliveries: int) -> str:
    return (
        f"delivered {deliveries} times, more than TRIAGE_MAX_DELIVERIES={max_deliveries}: workers kept reading it "
        "without finishing (it probably crashes or stalls them), so it is parked here instead of being retried again"
    )


def build_window(
    entries: list[RawEntry],
    source: str,
    prepare: Callable[[Sequence[str]], list],
    *,
    max_text_bytes: int,
    max_deliveries: int,
) -> Window:
    """Parse, drop poison entries, tokenize the rest in one call (one call per ticket if that call fails)."""
    t0 = time.perf_counter()
    w = Window(entries=entries, source=source)
    candidates: list[tuple[RawEntry, Ticket]] = []
    for e in entries:
        if e.unread is None:
            parsed = parse_entry(e.stream_id, e.fields, max_text_bytes=max_text_bytes)
        else:  # too large to read: only its measure came (source.py)
            parsed = Rejected(e.stream_id, e.unread.ticket_id(e.stream_id), e.unread.reason())
        if e.deliveries > max_deliveries:  # poison: never hand it to the model again
            w.rejected.append((e, parsed.ticket_id, poison_reason(e.deliveries, max_deliveries)))
        elif isinstance(parsed, Rejected):
            w.rejected.append((e, parsed.ticket_id, parsed.reason))
        else:
            candidates.append((e, parsed))
    prepared = prepare_isolated(prepare, [t.text for _, t in candidates])
    for (e, ticket), p in zip(candidates, prepared):
        if isinstance(p, Prepared):
            w.tickets.append(ticket)
            w.prepared.append(p)
        else:
            w.rejected.append((e, ticket.ticket_id, str(p)))
    w.tokenize_ms = (time.perf_counter() - t0) * 1000
    return w


def to_outcome(
    w: Window,
    predictions: Sequence[Prediction | Exception],
    *,
    model: str,
    worker: str,
    now_ms: float | None = None,
    excerpt_bytes: int = DEAD_LETTER_EXCERPT_BYTES,
) -> tuple[Outcome, list[float]]:
    """The whole window at once: ``rejections`` + ``pass_outcome`` for every ticket (predictions in ticket order)."""
    out, latencies = pass_outcome(
        w, range(len(w.tickets)), predictions, model=model, worker=worker, now_ms=now_ms, excerpt_bytes=excerpt_bytes
    )
    rejected = rejections(w, worker=worker, excerpt_bytes=excerpt_bytes)
    return Outcome(out.results, out.dead_letters + rejected.dead_letters, w.ids), latencies


def pass_outcome(
    w: Window,
    indices: Iterable[int],
    predictions: Sequence[Prediction | Exception],
    *,
    model: str,
    worker: str,
    now_ms: float | None = None,
    excerpt_bytes: int = DEAD_LETTER_EXCERPT_BYTES,
) -> tuple[Outcome, list[float]]:
    """Result records for the tickets at ``indices`` (latency = now - the entry id's enqueue time), a dead
    letter for each one the model failed on alone, and their acks.

    Returns the outcome and the latencies (ms) of the classified tickets."""
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    out = Outcome()
    latencies: list[float] = []
    for i, pred in zip(indices, predictions):
        ticket = w.tickets[i]
        out.ack_ids.append(ticket.stream_id)
        if isinstance(pred, Exception):
            reason = f"the model failed on this ticket even when run alone ({type(pred).__name__}: {short(pred)})"
            out.dead_letters.append(_dead(w.by_id[ticket.stream_id], ticket.ticket_id, reason, worker, excerpt_bytes))
            continue
        latency = max(0.0, now_ms - stream_id_ms(ticket.stream_id))
        latencies.append(latency)
        out.results.append(
            result_fields(
                ticket.ticket_id,
                pred,
                latency_ms=latency,
                model=model,
                worker=worker,
                meta=ticket.meta,
                stream_id=ticket.stream_id,
            )
        )
    return out, latencies


def rejections(w: Window, *, worker: str, excerpt_bytes: int = DEAD_LETTER_EXCERPT_BYTES) -> Outcome:
    """Dead letters (and acks) for the entries the window rejected before the model: parse errors, poison,
    tokenizer failures."""
    out = Outcome()
    for entry, ticket_id, reason in w.rejected:
        out.dead_letters.append(_dead(entry, ticket_id, reason, worker, excerpt_bytes))
        out.ack_ids.append(entry.stream_id)
    return out


def _dead(entry: RawEntry, ticket_id: str | None, reason: str, worker: str, excerpt_bytes: int) -> dict[str, str]:
    return dead_letter_fields(
        excerpt_bytes=excerpt_bytes,
        stream_id=entry.stream_id,
        reason=reason,
        payload=entry.fields or {},
        deliveries=entry.deliveries,
        ticket_id=ticket_id,
        worker=worker,
        unread=entry.unread,
    )
