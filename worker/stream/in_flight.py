"""What this process holds: stream ids read and not yet settled, with the group epoch each was read in."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from worker.stream.source import RawEntry, id_order


class InFlight:
    """Stream ids read by this process and not yet settled (written + acked, or dropped), with the
    group epoch they were read in.

    Re-reads of our own PEL and XAUTOCLAIM can return these again; they are skipped so no
    entry is classified twice inside one process. An id held from an older epoch (a lost
    group) does not block the same id delivered again by the recreated group."""

    def __init__(self) -> None:
        # in stream order (new reads come in order; anything else re-sorts it), so the lowest held is the first key
        self._ids: dict[str, int] = {}
        self._unread: set[str] = set()  # held as markers (too large to read): the keeper leaves them alone
        self._lock = threading.Lock()

    def add(self, ids: Sequence[str], epoch: int = 0, *, unread: Sequence[str] = ()) -> None:
        with self._lock:
            # against the last id held now (one parse): a bound kept across discards stayed above every later read
            # once a higher id (a non-id string, an older epoch's) had been held, and re-sorted at every add
            in_order, highest = True, id_order(next(reversed(self._ids))) if self._ids else (-1, -1)
            for i in ids:
                if i not in self._ids:  # one held already keeps its place (another epoch's read of it)
                    key = id_order(i)
                    if key > highest:
                        highest = key
                    else:
                        in_order = False
                self._ids[i] = epoch
            if not in_order:  # a claim or a re-read of older entries: rare, one sort
                self._ids = dict(sorted(self._ids.items(), key=lambda item: id_order(item[0])))
            self._unread.difference_update(ids)
            self._unread.update(unread)

    def discard(self, ids: Sequence[str], epoch: int = 0) -> None:
        with self._lock:
            for i in ids:
                if self._ids.get(i) == epoch:
                    del self._ids[i]
                    self._unread.discard(i)

    def fresh(self, entries: list[RawEntry], epoch: int = 0) -> list[RawEntry]:
        with self._lock:
            return [e for e in entries if self._ids.get(e.stream_id) != epoch]

    def snapshot(self, epoch: int, *, whole_only: bool = False) -> list[str]:
        with self._lock:
            return [i for i, e in self._ids.items() if e == epoch and not (whole_only and i in self._unread)]

    def lowest(self, excluding: Collection[str] = ()) -> str | None:
        """The lowest id held (any epoch) but those ``excluding`` (the ones a write settles: its trim comes after
        them), None when none: the settle's trim stays below it, so an entry of ours that its group lost (created
        again at '$') is still in the stream when its record is written."""
        with self._lock:
            return next((i for i in self._ids if i not in excluding), None)  # past the write's own ids only

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
