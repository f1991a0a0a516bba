"""The reader thread: decides what to read next (own pending -> reclaimed -> new), drains a
window (up to N entries or until the wait bound), parses and tokenizes it, and offers it
to the loop: ``next_window()`` hands the next one over, ``settled(window)`` says it is
written and acked (or dropped) and frees its slot.

Why a thread: while the model runs on window k, the next read and tokenization
(both mostly outside the GIL: socket waits, the Rust tokenizer) happen for window
k+1. Slots bound what is held: two windows with prefetch (one in the model, one
ready), one without, so a process never holds more read-but-unacked entries.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

from worker.observability import prometheus
from worker.stream.connection import Backoff, is_passing, is_transient
from worker.stream.group import GroupGuard, is_nogroup
from worker.stream.in_flight import InFlight
from worker.stream.messages import DELETED_REASON
from worker.stream.records import dead_letter_fields
from worker.stream.sink import Outcome, ResultSink
from worker.stream.sizing import WindowSizer
from worker.stream.source import RawEntry, StreamSource
from worker.stream.window import Window, build_window

END = "end"  # stop was requested; everything read before it has been queued
DRAINED = "drained"  # --drain: nothing undelivered, nothing pending


class Reader(threading.Thread):
    IDLE_BLOCK_MS = 500  # longest wait for new entries in one read (polled): bounds how late a stop is noticed
    DRAIN_BLOCK_MS = 100

    def __init__(
        self,
        source: StreamSource,
        prepare: Callable[[Sequence[str]], list],
        *,
        plan: Callable[[Sequence], list],
        guard: GroupGuard,
        sizer: WindowSizer,
        max_wait_ms: int,
        claim_idle_ms: int,
        max_deliveries: int,
        max_text_bytes: int,
        reconnect_max_s: float,
        stop: threading.Event,
        log,
        drain: bool = False,
        prefetch: bool = True,
        on_reconnect: Callable[[], None] | None = None,  # a read went through after failed tries
        orphans: ResultSink | None = None,
        on_orphans_dead_lettered: Callable[[int], None] | None = None,
    ):
        super().__init__(name="triage-reader", daemon=True)
        self.source = source
        self.prepare = prepare
        self.plan = plan  # a window's passes, planned here: the pass thread starts a window by launching its first
        self.guard = guard
        guard.on_recovered(self._group_recreated)
        self.sizer = sizer  # how many entries each window asks for
        self.cap_items = 0  # the window being read: asked of the sizer per window
        self.max_wait_ms = max_wait_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.max_text_bytes = max_text_bytes
        self.stop = stop
        self.log = log
        self.drain = drain
        self.on_reconnect = on_reconnect
        self.orphans = orphans  # writes dead letters for claimed entries Redis found deleted (no ownership check)
        self.on_orphans_dead_lettered = on_orphans_dead_lettered  # they belong to no window: the loop's totals
        self._ready: queue.Queue = queue.Queue()  # windows read and tokenized, then END / DRAINED / a crash
        self._slots = threading.Semaphore(2 if prefetch else 1)  # windows held (ready or in the loop), not settled
        self.in_flight = InFlight()
        self.backoff = Backoff(reconnect_max_s)
        self._pending_cursor: str | None = "0"  # re-read own PEL first: at start and after every reconnect
        self._claim_cursor = "0-0"
        self._claim_interval_s = min(max(claim_idle_ms / 2000.0, 0.1), 5.0)
        self._next_claim_s = 0.0  # claim on start: a dead predecessor's entries come first
        self._partial: list[RawEntry] = []
        self._read_ms = 0.0
        self._idle_s = 0.0
        self._epoch = 0  # the group epoch of the read in progress

    def _group_recreated(self) -> None:
        """A new group: nothing of ours is pending in it yet; read our own PEL and claims from the start again."""
        self._pending_cursor = "0"
        self._claim_cursor = "0-0"
        self._next_claim_s = 0.0

    # -------------------------------------------------------------- the loop's side
    def next_window(self, timeout_s: float) -> Window | str | BaseException | None:
        """The next window; ``END`` (stop requested, everything read was handed over), ``DRAINED`` (--drain:
        nothing left), the exception the reader died of, or None when nothing came within ``timeout_s``."""
        try:
            return self._ready.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def written(self, ids: Sequence[str], epoch: int) -> None:
        """A pass's entries are written and acked (or were another's): not held any more, so neither refreshed nor
        kept by the trim while the rest of their window runs."""
        self.in_flight.discard(ids, epoch)

    def settled(self, window: Window) -> None:
        """Every entry of ``window`` is written and acked, or the window was dropped: forget its ids, free its slot."""
        self.in_flight.discard(window.ids, window.epoch)
        self.sizer.settled()
        self._slots.release()

    def held(self) -> list[str]:
        """Ids this process holds in the current group epoch (read, not yet settled) that the keeper keeps fresh.

        Not entries held as markers (too large to read): the refresh checks each id is still in the stream with an
        XRANGE, a full copy inside Redis at every refresh (three held 40 MB entries: 260 ms of Redis, 42 MB of Lua
        heap). A marker's window only dead-letters it; should it outlast the claim idle time, whoever claims it
        reads a marker again and writes its dead letter (ours is skipped: the settle checks ownership)."""
        return self.in_flight.snapshot(self.guard.epoch, whole_only=True)

    # ----------------------------------------------------------------- thread
    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self._slots.acquire(timeout=0.2):
                    continue
                window = self._next_window()
                if window is None:
                    self._slots.release()
                    if self.drain and self._drained():
                        self._ready.put(DRAINED)
                        return
                    continue
                self._ready.put(window)
            self._ready.put(END)
        except BaseException as e:  # noqa: BLE001 - the main loop must learn the reader died
            self.log.exception("reader_crashed")
            self._ready.put(e)

    # ------------------------------------------------------------------ reads
    def _next_window(self) -> Window | None:
        self._partial, self._read_ms = [], 0.0
        self.cap_items = self.sizer.cap()
        if not self.cap_items:  # the probe window is out, nothing measured yet: no second window of unknown size
            self.stop.wait(0.02)
            return None
        source = "new"
        self._epoch = self.guard.epoch
        try:
            source, entries = self._read()
            failures = self.backoff.reset()
            if failures:
                if self.on_reconnect:  # one wait for Redis that ended, however many tries it took; counted first
                    self.on_reconnect()
                self.log.info("redis_reconnected", op="read", failed_attempts=failures)
        except Exception as e:  # noqa: BLE001 - the worker outlives Redis outages and surprises
            entries = self._partial  # already delivered to us: must be processed, not forgotten
            self._on_read_error(e)
        if not entries:
            self.sizer.idle()
            return None
        window = build_window(
            entries, source, self.prepare, max_text_bytes=self.max_text_bytes, max_deliveries=self.max_deliveries
        )
        window.read_ms, window.epoch, window.cap_items = self._read_ms, self._epoch, self.cap_items
        window.passes = self.plan(window.prepared) if window.prepared else []
        self.sizer.read(len(entries))
        try:
            state = self.source.group_state()
            if state is not None:
                window.backlog, window.pending = state.lag, state.pending
        except Exception:  # noqa: BLE001 - metrics only; a real outage shows up on the next read
            pass
        return window

    def _read(self) -> tuple[str, list[RawEntry]]:
        t0 = time.perf_counter()
        self._idle_s = 0.0  # the wait for a first new entry: no window yet, not its read time
        budget = self.source.limits.budget(self.cap_items)  # bytes this window may read (TRIAGE_READ_MAX_BYTES)
        try:
            if self._pending_cursor is not None:
                got, cursor = self.source.read_own_pending(
                    self._pending_cursor, self.cap_items, held=self.in_flight.snapshot(self._epoch), max_bytes=budget
                )
                # not if the group was recreated meanwhile: its reset to "0" stands
                self.guard.in_epoch(self._epoch, lambda: setattr(self, "_pending_cursor", cursor))
                fresh = self._take(got)
                if fresh:
                    return "pending", fresh
            if time.monotonic() >= self._next_claim_s:
                got, claim_cursor, deleted = self.source.autoclaim(
                    self._claim_cursor,
                    self.cap_items,
                    self.claim_idle_ms,
                    max_bytes=budget,
                    held=self.in_flight.snapshot(self._epoch),  # deleted ones of ours: their windows settle them
                )
                self.guard.in_epoch(self._epoch, lambda: self._keep_claim_cursor(claim_cursor))  # as above
                if deleted:
                    self._dead_letter_deleted(deleted)
                fresh = self._take(got)
                # in_hand: our own window, idle so long that we re-claimed it
                # from ourselves (or from a stale claimer)
                if got:
                    self.log.info(
                        "entries_claimed",
                        count=len(got),
                        in_hand=len(got) - len(fresh),
                        max_deliveries_seen=max(e.deliveries for e in got),
                    )
                if fresh:
                    return "claimed", fresh
            return "new", self._drain_new(budget)
        finally:
            self._read_ms = (time.perf_counter() - t0 - self._idle_s) * 1000

    def _dead_letter_deleted(self, ids: list[str]) -> None:
        """Pending entries of another consumer deleted from the stream (XDEL, a MAXLEN trim): XAUTOCLAIM drops them
        from the pending list, so without a dead letter nobody learns that their tickets were never classified (the
        process restarting under the dead one's name reads them from its own list and dead-letters them alike).
        Never one this process holds: the claim leaves those to their windows (no ownership check here, and Redis
        6.2 keeps a claimed deleted entry pending on us, so a window settling it meanwhile wrote its record too)."""
        letters = [
            dead_letter_fields(
                stream_id=i, reason=DELETED_REASON, payload={}, deliveries=0, worker=self.source.consumer
            )
            for i in ids
        ]
        if self.orphans is None:
            self.log.warning("claimed_entries_deleted", count=len(ids), dead_lettered=False)
            return
        backoff = Backoff(self.backoff.max_s)
        while True:  # Redis dropped them already: these ids in memory are all that is left
            try:
                self.orphans.write(Outcome(dead_letters=letters, ack_ids=list(ids)))
                break
            except Exception as e:  # noqa: BLE001 -- an outage passes: retry; anything else is only logged
                if not is_passing(e) or self.stop.is_set():
                    error = f"{type(e).__name__}: {e}"
                    self.log.error("claimed_entries_deleted", count=len(ids), ids=ids[:20], error=error)
                    return
                backoff.failed(self.stop)
        for d in letters:  # as the writer tells its own dead letters (not in the window counts)
            self.log.warning("dead_lettered", stream_id=d["stream_id"], id=None, reason=d["reason"], deliveries=0)
        prometheus.current().on_written(Outcome(dead_letters=letters))
        if self.on_orphans_dead_lettered is not None:
            self.on_orphans_dead_lettered(len(letters))
        self.log.warning(
            "claimed_entries_deleted",
            count=len(ids),
            dead_lettered=True,
            note="pending entries gone from the stream (XDEL/XTRIM); Redis dropped them from the pending list",
        )

    def _keep_claim_cursor(self, cursor: str) -> None:
        self._claim_cursor = cursor
        if cursor == "0-0":  # a full sweep done: the next one after the claim interval
            self._next_claim_s = time.monotonic() + self._claim_interval_s

    def _take(self, entries: list[RawEntry]) -> list[RawEntry]:
        fresh = self.in_flight.fresh(entries, self._epoch)
        unread = [e.stream_id for e in fresh if e.unread is not None]
        self.in_flight.add([e.stream_id for e in fresh], self._epoch, unread=unread)
        return fresh

    def _take_new(self, read: list[RawEntry]) -> list[RawEntry]:
        """``_take`` for first deliveries (XREADGROUP >): an id held in this epoch can come as new only from a group
        recreated underneath, where this process met no NOGROUP (``GroupGuard.found_recreated``)."""
        fresh = self._take(read)
        if len(fresh) < len(read):
            taken = {e.stream_id for e in fresh}
            again = [e.stream_id for e in read if e.stream_id not in taken]
            self.guard.found_recreated(self._epoch, op="read", ids=again)
        return fresh

    def _drain_new(self, budget: int) -> list[RawEntry]:
        """Up to N entries and ``budget`` bytes: wait until the first arrives, then at most max_wait_ms more to fill."""
        block = self.DRAIN_BLOCK_MS if self.drain else self.IDLE_BLOCK_MS
        read = self.source.read_new(self.cap_items, block, budget, stop=self.stop)
        self._idle_s = read.idle_s
        budget -= read.looked_at
        got = self._take_new(read)
        self._partial = got
        if not got:
            return got
        first_s = time.monotonic()
        while len(got) < self.cap_items and budget > 0 and not self.stop.is_set():
            left_ms = self.max_wait_ms - (time.monotonic() - first_s) * 1000
            if left_ms < 1:
                break
            read = self.source.read_new(self.cap_items - len(got), int(left_ms), budget, stop=self.stop)
            budget -= read.looked_at
            got.extend(self._take_new(read))
        return got

    def _on_read_error(self, e: Exception) -> None:
        self._pending_cursor = "0"  # a lost reply may have delivered entries we never saw
        if is_nogroup(e):
            try:
                self.guard.recover(self._epoch, op="read", error=e)
                return
            except Exception as again:  # noqa: BLE001 - Redis went away again: back off below
                e = again
        if is_transient(e):
            delay = self.backoff.failed(self.stop)
            self.log.warning(
                "redis_unavailable",
                op="read",
                error=f"{type(e).__name__}: {e}",
                attempt=self.backoff.attempt,
                retried_after_s=round(delay, 2),
            )
        else:
            delay = self.backoff.failed(self.stop)
            self.log.error(
                "read_failed",
                error=f"{type(e).__name__}: {e}",
                attempt=self.backoff.attempt,
                retried_after_s=round(delay, 2),
            )

    def _drained(self) -> bool:
        if len(self.in_flight):
            return False
        try:
            return self.source.is_drained()
        except Exception as e:  # noqa: BLE001
            self._on_read_error(e)
            return False
