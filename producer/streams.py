"""Reading the worker's results and dead-letter streams: follow, the latest records, decoded dead letters, and the
lookup of a submission's record that its result key cannot answer.

Why one place: both streams hold a ticket's outcome (a result, or a dead letter with its reason), so every reader
here reads both and turns either into a ``Result`` of the same shape ``wait`` returns. Split out of
``producer.client``, which re-exports what callers use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from producer.redis_errors import asking, execute
from producer.results import Result, as_str, decode_flat

if TYPE_CHECKING:
    from producer.client import TriageClient

FOLLOW_COUNT = 500  # entries per stream per XREAD while following


def entry_id(stream_id: str | None) -> tuple[int, int] | None:
    """``"<ms>-<seq>"`` (or ``"<ms>"``) as a pair to compare; None if it is no entry id."""
    try:
        ms, _, seq = (stream_id or "").partition("-")
        return int(ms), int(seq or 0)
    except ValueError:
        return None


def entry_after(a: str | None, b: str | None) -> bool:
    """Stream entry id ``a`` comes after ``b`` (False if either is not an entry id)."""
    ia, ib = entry_id(a), entry_id(b)
    return ia is not None and ib is not None and ia > ib


def decode_dead_letter(sid: Any, fields: Mapping[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {as_str(k): as_str(v) for k, v in fields.items()}
    for k in ("payload", "meta"):
        if k in out:
            try:
                out[k] = json.loads(out[k])
            except ValueError:
                pass  # kept as the string it is
    decode_flat(out)
    out["dead_letter_id"] = as_str(sid)
    return out


def is_since(text: Any) -> bool:
    """``$`` or what XREAD takes as an entry id (``0``, ``<ms>``, ``<ms>-<seq>``): checked before any read, so a
    typo is a usage error, not a Redis error part-way."""
    return text == "$" or (isinstance(text, str) and re.fullmatch(r"[0-9]+(-[0-9]+)?", text) is not None)


def is_entry_id(text: Any) -> bool:
    """A full stream entry id (``<ms>-<seq>``), as XADD returns: what an ``--ids-out`` file must hold."""
    return isinstance(text, str) and re.fullmatch(r"[0-9]+-[0-9]+", text) is not None


def _valid_since(since: str) -> str:
    if not is_since(since):
        raise ValueError(f"since must be '$', '0' or a stream entry id such as 1700000000000-0, got {since!r}")
    return since


def _merged(rows: list[tuple[str, Any, Any]], results_stream: str) -> list[tuple[Any, Any]]:
    """(stream, entry id, fields) of both streams in entry-id order, a result before a dead letter of the same id."""
    rows.sort(key=lambda r: (entry_id(as_str(r[1])) or (0, 0), r[0] != results_stream))
    return [(sid, fields) for _, sid, fields in rows]


def recent(client: TriageClient, count: int, dead_letters: bool) -> list[Result]:
    """The last ``count`` records of the results stream (and the dead-letter stream), oldest first."""
    names = _names(client, dead_letters)
    pipe = client.redis.pipeline(transaction=False)
    for name in names:
        pipe.xrevrange(name, count=count)
    rows = [(name, sid, fields) for name, got in zip(names, execute(pipe, "XREVRANGE", names)) for sid, fields in got]
    return [Result.from_stream(sid, fields) for sid, fields in _merged(rows, names[0])[-count:]]


def follow(
    client: TriageClient,
    since: str | Mapping[str, str],
    block_ms: int,
    stop: Callable[[], bool] | None,
    dead_letters: bool,
) -> Iterator[Result]:
    """Records of both streams as they are written, each from its own cursor: checked, and ``$`` resolved to each
    stream's tail, in this call, so nothing written after it is skipped however late the first read comes."""
    names = _names(client, dead_letters)
    wanted = {n: (since.get(n, "$") if isinstance(since, Mapping) else since) for n in names}
    for start in wanted.values():
        _valid_since(start)
    tails = client.outcome_tails() if "$" in wanted.values() else {}  # now: "only new" counts from this call
    return _follow(client, {n: tails[n] if start == "$" else start for n, start in wanted.items()}, block_ms, stop)


def _follow(client: TriageClient, cursors: dict[str, str], block_ms: int, stop) -> Iterator[Result]:
    results_stream = client.settings.results_stream
    while not (stop and stop()):
        with asking("XREAD", ", ".join(cursors)):
            reply = client.redis.xread(cursors, count=FOLLOW_COUNT, block=client._block_ms(block_ms))
        rows = []
        for name, entries in reply or []:
            for sid, fields in entries:
                cursors[as_str(name)] = as_str(sid)
                rows.append((as_str(name), sid, fields))
        for sid, fields in _merged(rows, results_stream):
            yield Result.from_stream(sid, fields)


def _names(client: TriageClient, dead_letters: bool) -> list[str]:
    s = client.settings
    return [s.results_stream, s.dead_letter_stream] if dead_letters else [s.results_stream]


class StreamScan:
    """Find results of submissions the result key cannot answer (it answers a later send of the id, or
    it expired) in the results and dead-letter streams: every record for an input entry is written
    after that entry, so reading from the earliest such entry's millisecond onwards sees them all (unless trimmed)."""

    PAGE = 1000

    def __init__(self, client: TriageClient):
        self.client = client
        self.wanted: dict[str, str] = {}  # input entry id -> ticket id
        self.cursors: dict[str, str] = {}
        self.hits: dict[str, Result] = {}

    def add(self, ticket_id: str, stream_id: str) -> None:
        if stream_id in self.wanted:
            return
        self.wanted[stream_id] = ticket_id
        # from the start of the entry's millisecond: another stream's ids restart their sequence each millisecond,
        # so a record written in that same millisecond may have a lower id than the entry (it was missed)
        ms = (entry_id(stream_id) or (0, 0))[0]
        start = f"{ms - 1}-{2**64 - 1}" if ms > 0 else "0-0"
        s = self.client.settings
        for name in (s.results_stream, s.dead_letter_stream):
            cur = self.cursors.get(name)
            if cur is None or entry_after(cur, start):
                self.cursors[name] = start  # (re)start from the earliest wanted entry

    def found(self) -> dict[str, Result]:
        open_ids = {sid for sid, tid in self.wanted.items() if tid not in self.hits}
        for name in list(self.cursors):
            while open_ids:
                with asking("XRANGE", name):
                    rows = self.client.redis.xrange(name, min="(" + self.cursors[name], max="+", count=self.PAGE)
                for rid, fields in rows:
                    self.cursors[name] = as_str(rid)
                    sid = as_str(fields.get("stream_id") or fields.get(b"stream_id") or "")
                    if sid in open_ids:
                        self.hits[self.wanted[sid]] = Result.from_stream(rid, fields)
                        open_ids.discard(sid)
                if len(rows) < self.PAGE:
                    break
        return dict(self.hits)
