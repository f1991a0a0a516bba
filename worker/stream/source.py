"""Reading the input stream through a consumer group: new entries, this consumer's own
pending entries, entries reclaimed from dead consumers (XAUTOCLAIM), delivery counts.

Only Redis calls live here; the policy of when to call what is in ``reader.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker.stream.messages import EntryFields, as_text
from worker.stream.scripts import read_own_script, refresh_script

PENDING_PAGE = 1000  # XPENDING rows per call when reading delivery counts


@dataclass
class RawEntry:
    stream_id: str
    fields: dict | None  # raw bytes -> bytes; None/{} when the entry was deleted
    deliveries: int  # times delivered, this delivery included (XPENDING)
    source: str  # "new" | "pending" | "claimed"


@dataclass(frozen=True)
class GroupState:
    lag: int | None  # entries not yet delivered to the group (None: Redis cannot tell)
    pending: int  # delivered, not acked (all consumers)
    last_delivered_id: str


class StreamSource:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str):
        self.client = keep_field_pairs(client)
        self.stream = stream
        self.group = group
        self.consumer = consumer

    # ------------------------------------------------------------------ setup
    @property
    def recovery_key(self) -> str:
        """Beside the group: the id below which every entry is settled (written by each settle, see scripts.py)."""
        return recovery_key(self.stream, self.group)

    def ensure_group(self) -> str | None:
        """Create the group (and the stream) if missing; the start id if created, None if it existed.

        A new group starts after the recovery point when the stream has one (the group was lost:
        XGROUP DESTROY, a restore), else at the stream's first entry, so tickets pushed before any
        worker ever ran are classified too."""
        start = self.recovery_start()
        try:
            self.client.xgroup_create(self.stream, self.group, id=start, mkstream=True)
            return start
        except redis.ResponseError as e:
            if "BUSYGROUP" in str(e):
                return None
            raise

    def recovery_start(self) -> str:
        """The id to create the group at: just below the recovery point if the stream still has one, else 0."""
        pipe = self.client.pipeline(transaction=True)
        pipe.exists(self.stream)
        pipe.get(self.recovery_key)
        exists, point = pipe.execute()
        if not exists or not point:
            return "0"
        return id_before(as_text(point))

    def key_type(self, key: str) -> str:
        return as_text(self.client.type(key))

    # ------------------------------------------------------------------ reads
    def read_new(self, count: int, block_ms: int | None) -> list[RawEntry]:
        """XREADGROUP ... > : entries never delivered to anyone (first delivery, count 1)."""
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return [RawEntry(as_text(i), f, 1, "new") for i, f in _entries(reply)]

    def read_own_pending(
        self, after_id: str, count: int, held: Sequence[str] = ()
    ) -> tuple[list[RawEntry], str | None]:
        """This consumer's delivered-but-unacked entries after ``after_id`` ("0": from the first), except ``held``
        (read by this process and not settled yet), and where the next page starts (None: this was the last).

        Each entry handed out counts as another delivery, which is what makes a restart loop on one poison entry
        visible in its delivery count; held entries are not counted again (scripts.READ_OWN)."""
        start = "-" if after_id in ("0", "0-0") else "(" + after_id
        reply = read_own_script(self.client, [self.stream], [self.group, self.consumer, start, count, *held])
        entries = [
            RawEntry(as_text(reply[k]), _field_dict(reply[k + 2]), int(reply[k + 1]), "pending")
            for k in range(1, len(reply), 3)
        ]
        return entries, as_text(reply[0]) or None

    def autoclaim(self, cursor: str, count: int, min_idle_ms: int) -> tuple[list[RawEntry], str, list[str]]:
        """XAUTOCLAIM entries idle >= ``min_idle_ms`` (from any consumer, dead or stuck).

        Returns (entries now ours, next cursor ("0-0" = scan complete), ids that were
        pending but deleted from the stream; Redis drops those from the PEL itself)."""
        reply = self.client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_ms, start_id=cursor, count=count
        )
        next_cursor, claimed = as_text(reply[0]), reply[1] or []
        deleted = [as_text(i) for i in reply[2]] if len(reply) > 2 and reply[2] else []
        entries = [RawEntry(as_text(i), f, 0, "claimed") for i, f in claimed if i is not None]
        self._fill_deliveries(entries)
        return entries, next_cursor, deleted

    def _fill_deliveries(self, entries: list[RawEntry]) -> None:
        counts = self.delivery_counts([e.stream_id for e in entries])
        for e in entries:
            e.deliveries = counts.get(e.stream_id, 1)

    def delivery_counts(self, ids: list[str]) -> dict[str, int]:
        """How often each of ``ids`` was delivered, for those pending on this consumer: one XPENDING range scan
        from the lowest to the highest id (pages of ``PENDING_PAGE``), not one XPENDING per id."""
        if not ids:
            return {}
        wanted = set(ids)
        start, hi = min(ids, key=id_order), max(ids, key=id_order)
        out: dict[str, int] = {}
        while True:
            rows = self.client.xpending_range(
                self.stream, self.group, min=start, max=hi, count=PENDING_PAGE, consumername=self.consumer
            )
            for row in rows:
                i = as_text(row["message_id"])
                if i in wanted:
                    out[i] = int(row["times_delivered"])
            if len(rows) < PENDING_PAGE:
                return out
            start = "(" + as_text(rows[-1]["message_id"])

    # ------------------------------------------------------------------ state
    def group_state(self) -> GroupState | None:
        for g in self.client.xinfo_groups(self.stream):
            if as_text(g.get("name")) == self.group:
                lag = g.get("lag")
                return GroupState(
                    lag=None if lag is None else int(lag),
                    pending=int(g.get("pending") or 0),
                    last_delivered_id=as_text(g.get("last-delivered-id") or b"0-0"),
                )
        return None

    def is_drained(self) -> bool:
        """No entry waits for a first delivery and none is pending on any consumer."""
        state = self.group_state()
        if state is None:
            return False
        if state.pending:
            return False
        # precise even when XINFO's lag is unknown (after XDEL): is there an entry past the last delivered one?
        after = self.client.xrange(self.stream, min="(" + state.last_delivered_id, max="+", count=1)
        return not after

    def refresh(self, ids: list[str]) -> int:
        """Reset the idle time of those of ``ids`` still pending on this consumer (see scripts.REFRESH)."""
        if not ids:
            return 0
        return int(refresh_script(self.client, [self.stream], [self.group, self.consumer, *ids]))


def id_order(stream_id: str) -> tuple[int, int]:
    """Sort key of a stream id ("<ms>-<seq>"); anything else sorts after every real id."""
    ms, _, seq = stream_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 2**64, 0


def recovery_key(stream: str, group: str) -> str:
    return f"{stream}:recovery:{group}"


def id_before(stream_id: str) -> str:
    """The stream id just below ``stream_id`` (XGROUP CREATE <id> delivers the entries after <id>)."""
    ms, seq = (int(x) for x in stream_id.split("-", 1))
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{2**64 - 1}" if ms > 0 else "0"


def _field_dict(flat: Any) -> dict | None:
    """A flat [name, value, ...] reply (a script's, XREADGROUP's, XAUTOCLAIM's) as the entry's fields (None: the
    entry was deleted; Lua's false arrives as a null over RESP2 and as a boolean over RESP3)."""
    if not isinstance(flat, list):
        return None
    pairs = iter(flat)
    fields = dict(zip(pairs, pairs))  # as fast as redis-py's own parser: a window is thousands of entries
    return fields if 2 * len(fields) == len(flat) else EntryFields(flat)  # a name given twice: keep every pair


def _stream_list(rows: Any) -> list:
    """redis-py's ``parse_stream_list``, the fields kept as ``EntryFields`` (raw pairs, repeated names)."""
    return [(r[0], _field_dict(r[1])) if r is not None else (None, None) for r in rows or []]


def _parse_xread(response: Any, **options: Any) -> Any:
    """XREADGROUP's reply in redis-py's shape (RESP2 list, RESP3 map), fields as ``EntryFields``."""
    if response is None:
        return []
    if isinstance(response, dict):
        return {name: [_stream_list(rows)] for name, rows in response.items()}
    return [[r[0], _stream_list(r[1])] for r in response]


def _parse_xautoclaim(response: Any, **options: Any) -> Any:
    if options.get("parse_justid", False):
        return response[1]
    response[1] = _stream_list(response[1])
    return response


def keep_field_pairs(client: redis.Redis) -> redis.Redis:
    """Have ``client`` read entries as ``EntryFields``: redis-py's own parsers make a dict of each entry, keeping a
    repeated name's last value only (``text`` sent twice: classified on the second, dead-lettered on an empty one)."""
    client.set_response_callback("XREADGROUP", _parse_xread)
    client.set_response_callback("XAUTOCLAIM", _parse_xautoclaim)
    return client


def _entries(reply: Any) -> list[tuple[Any, Any]]:
    """Flatten redis-py's XREADGROUP reply (RESP2 list or RESP3 dict) to (id, fields) pairs."""
    if not reply:
        return []
    if isinstance(reply, dict):
        streams = reply.values()
        return [pair for s in streams for pair in (s[0] if s and isinstance(s[0], list) else s)]
    return [pair for _name, pairs in reply for pair in pairs]
