"""Reading the input stream through a consumer group: new entries, this consumer's own
pending entries, entries reclaimed from dead consumers (XAUTOCLAIM's work), delivery counts.

Every read is a script that measures each entry in Redis first (``read_scripts.py``): a read
brings at most a byte budget plus one entry, and an entry too large to be a ticket comes as
its measure (``Unread``), never whole. Only Redis calls live here; the policy of when to call
what is in ``reader.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker.stream.messages import EntryFields, Unread, as_text, entry_max_bytes
from worker.stream.read_scripts import any_after_script, claim_script, read_new_script, read_own_script
from worker.stream.records import DEAD_LETTER_EXCERPT_BYTES
from worker.stream.scripts import refresh_script

# Scripts cannot block: an empty read is asked again after 1 ms, then twice as long each time, at most POLL_MAX_S
# (a new ticket waits at most this long for a worker that found one a moment ago); once nothing new came for
# POLL_SLOW_AFTER_S, at most POLL_SLOW_S (an idle worker sends ~10 reads a second, not ~50; the first ticket after
# a quiet spell waits up to that long). Measured in docs/worker.md, "Read size".
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.02
POLL_SLOW_AFTER_S, POLL_SLOW_S = 30.0, 0.1
CUT = "…".encode()  # ends a value of an unread entry that came cut


@dataclass
class RawEntry:
    stream_id: str
    fields: dict | None  # raw bytes -> bytes; None/{} when the entry was deleted; the first bytes when ``unread``
    deliveries: int  # times delivered, this delivery included (XPENDING)
    source: str  # "new" | "pending" | "claimed"
    unread: Unread | None = None  # too large to read: what Redis measured of it instead (dead-lettered)


class Entries(list):
    """The entries of one read, and the bytes of every entry it looked at (``looked_at``; unread ones in full)."""

    looked_at = 0
    idle_s = 0.0  # read_new: waited before the read that found them (no entry to read yet: not this window's work)


class PollPause:
    """How long the wait for new entries sleeps before it asks again (``POLL_*``). Kept across reads: a worker that
    has found nothing for a while keeps its slow pace from one wait to the next, and any entry found restarts it."""

    def __init__(self) -> None:
        self._pause = POLL_FIRST_S
        self._quiet_since: float | None = None  # since when reads found nothing (None: the last one found some)

    def found(self, anything: bool, now: float) -> None:
        if anything:
            self._pause, self._quiet_since = POLL_FIRST_S, None
        elif self._quiet_since is None:
            self._quiet_since = now

    def next(self, now: float) -> float:
        """The next sleep: 1 ms, twice the one before, at most POLL_MAX_S (POLL_SLOW_S after a quiet spell)."""
        slow = self._quiet_since is not None and now - self._quiet_since >= POLL_SLOW_AFTER_S
        pause = min(self._pause, POLL_SLOW_S if slow else POLL_MAX_S)
        self._pause = 2 * pause
        return pause


# The default budget's ceiling: a read script holds Redis ~1.5-2.2 ms per MB it looks at, so 4,096 tickets x 64 KiB
# (256 MiB) held it up to ~0.6 s; 64 MiB is ~0.15 s, and cuts only windows whose tickets average over 16 KiB.
DEFAULT_READ_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ReadLimits:
    """How much one read may bring into the worker. ``max_bytes`` (TRIAGE_READ_MAX_BYTES) bounds a window's
    reads; unset, it is the tickets asked for x ``max_text_bytes``, at most 64 MiB. An entry over
    ``entry_max_bytes`` comes as its measure and the first bytes of its first 32 fields, ``excerpt_bytes`` in all
    (a dead letter keeps no more)."""

    max_text_bytes: int = 65_536
    excerpt_bytes: int = DEAD_LETTER_EXCERPT_BYTES
    max_bytes: int | None = None

    @classmethod
    def for_worker(cls, settings) -> ReadLimits:
        return cls(settings.max_text_bytes, settings.dead_letter_excerpt_bytes, settings.read_max_bytes)

    @property
    def entry_max_bytes(self) -> int:
        return entry_max_bytes(self.max_text_bytes)

    def budget(self, items: int) -> int:
        """Bytes a window of ``items`` tickets may read: unset, ``items`` x ``max_text_bytes`` up to
        ``DEFAULT_READ_MAX_BYTES``."""
        if self.max_bytes is not None:
            return self.max_bytes
        return min(max(items, 1) * self.max_text_bytes, max(DEFAULT_READ_MAX_BYTES, self.max_text_bytes))


@dataclass(frozen=True)
class GroupState:
    lag: int | None  # entries not yet delivered to the group (None: Redis cannot tell)
    pending: int  # delivered, not acked (all consumers)
    last_delivered_id: str


class StreamSource:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str, limits: ReadLimits | None = None):
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.limits = limits or ReadLimits()
        self.poll = PollPause()  # the wait for new entries (read_new)

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
    def read_new(
        self, count: int, block_ms: int | None = None, max_bytes: int | None = None, stop: threading.Event | None = None
    ) -> Entries:
        """Entries never delivered to anyone (XREADGROUP >; first delivery, count 1): at most ``count``, and no more
        once they reach ``max_bytes`` (default: the budget of ``count`` tickets). With ``block_ms``, waits that long
        for the first one, asking again every few ms (``PollPause``): a blocking read would hand over whatever
        entry woke it, whatever its size. ``stop`` set ends the wait (a warm stop waited out a long
        TRIAGE_MAX_WAIT_MS)."""
        budget = self.limits.budget(count) if max_bytes is None else max_bytes
        got = self._read_new(count, budget)
        if got or not block_ms:
            return got
        started = time.monotonic()
        deadline = started + block_ms / 1000
        while (left := deadline - time.monotonic()) > 0 and not (stop is not None and stop.is_set()):
            time.sleep(min(self.poll.next(time.monotonic()), left))
            asked = time.monotonic()
            got = self._read_new(count, budget)
            if got:
                got.idle_s = asked - started
                break
        return got

    def _read_new(self, count: int, budget: int) -> Entries:
        whole, unread, looked_at = read_new_script(self.client, [self.stream], [*self._head(budget), count])
        got = self._entries(whole, unread, "new")
        got.looked_at = looked_at
        self.poll.found(bool(got), time.monotonic())
        return got

    def read_own_pending(
        self, after_id: str, count: int, held: Sequence[str] = (), max_bytes: int | None = None
    ) -> tuple[list[RawEntry], str | None]:
        """This consumer's delivered-but-unacked entries after ``after_id`` ("0": from the first), except ``held``
        (read by this process and not settled yet), up to ``max_bytes``, and where the next page starts (None: this
        was the last).

        Each entry handed out counts as another delivery, which is what makes a restart loop on one poison entry
        visible in its delivery count; held entries are not counted again (read_scripts.READ_OWN)."""
        start = "-" if after_id in ("0", "0-0") else "(" + after_id
        budget = self.limits.budget(count) if max_bytes is None else max_bytes
        cursor, whole, unread = read_own_script(self.client, [self.stream], [*self._head(budget), start, count, *held])
        return self._entries(whole, unread, "pending"), as_text(cursor) or None

    def autoclaim(
        self, cursor: str, count: int, min_idle_ms: int, max_bytes: int | None = None, held: Sequence[str] = ()
    ) -> tuple[list[RawEntry], str, list[str]]:
        """Claim entries idle >= ``min_idle_ms`` (from any consumer, dead or stuck), as XAUTOCLAIM does, up to
        ``max_bytes`` (read_scripts.CLAIM).

        Returns (entries now ours, next cursor ("0-0" = scan complete), ids that were
        pending but deleted from the stream; dropped from the PEL as XAUTOCLAIM drops them, on Redis 6.2 by the ack
        of their dead letters). A deleted entry pending on this consumer and in ``held`` (read by this process, not
        settled yet) is left to its window: neither claimed nor returned."""
        budget = self.limits.budget(count) if max_bytes is None else max_bytes
        next_cursor, whole, unread, deleted = claim_script(
            self.client, [self.stream], [*self._head(budget), min_idle_ms, cursor, count, *held]
        )
        return self._entries(whole, unread, "claimed"), as_text(next_cursor), [as_text(i) for i in deleted or []]

    def _head(self, budget: int) -> list:
        """The arguments every read script starts with (read_scripts.py)."""
        return [max(budget, 1), self.limits.entry_max_bytes, self.limits.excerpt_bytes, self.group, self.consumer]

    def _entries(self, whole: list, unread: list, source: str) -> Entries:
        """A script's flat (id, times delivered, fields) triples, then its markers, as entries."""
        got = Entries(
            [
                RawEntry(as_text(whole[k]), _field_dict(whole[k + 2]), int(whole[k + 1]), source)
                for k in range(0, len(whole), 3)
            ]
        )
        for k in range(0, len(unread), 3):
            got.append(self._unread(as_text(unread[k]), int(unread[k + 1]), unread[k + 2], source))
        if unread and whole:  # in stream order, as read (the script returns markers apart); rare: no cost otherwise
            got.sort(key=lambda e: id_order(e.stream_id))
        return got

    def _unread(self, stream_id: str, deliveries: int, m: list, source: str) -> RawEntry:
        """A marker as an entry: its first bytes as its fields (for the dead letter), its measure as ``unread``."""
        fields = tuple((m[j], int(m[j + 1]), m[j + 2]) for j in range(2, len(m), 3))
        measure = Unread(int(m[0]), int(m[1]), fields, self.limits.entry_max_bytes, self.limits.max_text_bytes)
        head = EntryFields([x for name, n, first in fields for x in (name, first if n == len(first) else first + CUT)])
        return RawEntry(stream_id, head, deliveries, source, measure)

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
        # (asked in Redis: that entry may be one too large to read)
        return not any_after_script(self.client, [self.stream], [state.last_delivered_id])

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
    """A flat [name, value, ...] reply (a read script's) as the entry's fields (None: the entry was deleted; Lua's
    false arrives as a null over RESP2 and as a boolean over RESP3)."""
    if not isinstance(flat, list):
        return None
    pairs = iter(flat)
    fields = dict(zip(pairs, pairs))  # as fast as redis-py's own parser: a window is thousands of entries
    return fields if 2 * len(fields) == len(flat) else EntryFields(flat)  # a name given twice: keep every pair
