"""Liveness as a Redis key with a TTL, refreshed from its own thread (``Keeper``), and what the
worker is doing right now (``Status``).

A key that expires on its own needs no cleanup after a kill -9, and any process that can
reach Redis (``triage-worker healthcheck``, ``status``, a dashboard, redis-cli) can check it.
The key is refreshed by a thread, not between windows, so a pass that runs for minutes does
not make a working worker look dead; ``phase`` / ``phase_since_ms`` / ``pass_started_at_ms``
tell a stuck pass from a long one.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from worker.keyspace import keys_under
from worker.stream.scripts import error_code, heartbeat_script, leave_script, release_script

PHASES = ("starting", "reading", "inferring", "writing", "idle", "stopping")


def now_ms() -> int:
    return int(time.time() * 1000)


class Status:
    """The loop's current phase and counters; written by the loop, read by the heartbeat thread.

    Once ``stop`` is set (a warm shutdown, ``--drain`` done) the phase is ``stopping`` until the exit: ops see a
    worker finishing what it holds, not one that looks busy. A pass it finishes meanwhile keeps its clock
    (``pass_started_at_ms``). The signal handler only sets the event; the phase moves at the loop's next step or
    the keeper's next beat, never inside the handler (which could interrupt a holder of this lock)."""

    def __init__(self, on_phase: Callable[[str], None] | None = None, stop: threading.Event | None = None) -> None:
        self._lock = threading.Lock()
        self._on_phase = on_phase  # e.g. the Prometheus phase gauge
        self._stop = stop
        self.phase = "starting"
        self.phase_since_ms = now_ms()
        self.pass_started_at_ms: int | None = None
        self.counters: dict[str, int] = {"windows": 0, "items": 0, "dead_lettered": 0}
        self.on_moved: Callable[[], None] | None = None  # at a change of phase or a pass start (the keeper beats soon)

    def _shown(self, phase: str) -> str:
        return "stopping" if self._stop is not None and self._stop.is_set() else phase

    def _move(self, phase: str, pass_clock: str) -> None:
        """Enter ``phase`` (a no-op if already there); the pass clock is kept, cleared or started."""
        with self._lock:
            t = now_ms()
            changed = phase != self.phase
            if changed:
                self.phase, self.phase_since_ms = phase, t
            if pass_clock != "keep":
                self.pass_started_at_ms = t if pass_clock == "start" else None
        if changed and self._on_phase is not None:
            self._on_phase(phase)
        if (changed or pass_clock == "start") and self.on_moved is not None:  # a new pass: its clock is news too
            self.on_moved()

    def set_phase(self, phase: str) -> None:
        assert phase in PHASES, phase
        self._move(self._shown(phase), "keep" if phase == "inferring" else "clear")

    def pass_started(self) -> None:
        """Phase "inferring" and the pass clock start together, so a reader never sees one without the other.

        The clock stays until the phase moves on: between two passes of a window the last pass's start shows."""
        self._move(self._shown("inferring"), "start")

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.counters[k] = self.counters.get(k, 0) + v

    def snapshot(self) -> dict:
        """Phase and counters; ``batches`` repeats ``windows`` for probes written before the rename."""
        if self._shown(self.phase) != self.phase:  # a stop the loop has not seen yet (a pass still running)
            self._move("stopping", "keep")
        with self._lock:
            return {
                "phase": self.phase,
                "phase_since_ms": self.phase_since_ms,
                "pass_started_at_ms": self.pass_started_at_ms,
                **self.counters,
                "batches": self.counters["windows"],
            }


class NameInUse(Exception):
    """Another live process beats under this consumer name (``holder``: its heartbeat)."""

    def __init__(self, holder: dict):
        super().__init__(f"consumer name in use by host {holder.get('host')} pid {holder.get('pid')}")
        self.holder = holder


DEFAULT_TTL_S = 30  # settings.heartbeat_ttl_s's default: assumed for a heartbeat that does not say its TTL


@dataclass(frozen=True)
class Claim:
    """What ``Heartbeat.claim`` did: ``took`` the name (False: a stop came first), from ``previous`` (its holder's
    heartbeat, {} for a key that was none; None: the name was free)."""

    took: bool
    previous: dict | None


class Heartbeat:
    """This process's heartbeat key, written only while the consumer name is its own.

    Each process beats with its own ``instance`` id, and every write is a compare-and-set (``scripts.HEARTBEAT``):
    a process frozen past its TTL whose name was taken over meanwhile finds the other's heartbeat on its next beat,
    writes nothing and is told (``beat`` returns that heartbeat), and ``clear`` at exit leaves the other's key."""

    def __init__(self, client: redis.Redis, key_prefix: str, consumer: str, ttl_s: int, info: dict | None = None):
        self.client = client
        self.key = key_prefix + consumer
        self.ttl_s = ttl_s
        self.instance = uuid.uuid4().hex[:16]
        self.info = {
            "consumer": consumer,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "instance": self.instance,
            "ttl_s": ttl_s,
            **(info or {}),
        }
        self.started_at_ms = now_ms()

    def beat(self, **status) -> dict | None:
        """Refresh the key; None when written, else the heartbeat of the process that holds the name now (the key
        is left to it). A key that expired (a Redis restarted empty, a freeze) is written again."""
        written, value = self._write(status)
        return None if written else parse_heartbeat(value)

    def _write(self, status: dict, replaces: bytes | str = "") -> tuple[bool, bytes | str | None]:
        """(written, the value replaced or the holder's value); see ``scripts.HEARTBEAT``."""
        state, value = heartbeat_script(
            self.client, [self.key], [self.instance, self._value(status), self.ttl_s, replaces]
        )
        return state in (b"written", "written"), value

    def _value(self, status: dict) -> str:
        return json.dumps({**self.info, "started_at_ms": self.started_at_ms, "beat_at_ms": now_ms(), **status})

    def claim(
        self, stop: threading.Event, on_wait: Callable[[dict, float], None] | None = None, poll_s: float = 0.1
    ) -> Claim:
        """Take the consumer name for this process before anything is read, as rq refuses a worker name that is
        alive. Two processes under one name re-read each other's pending entries (duplicates; delivery counts that
        reach TRIAGE_MAX_DELIVERIES), so a name whose heartbeat another process refreshes raises ``NameInUse``.

        A holder that does not beat again is dead (kill -9): its key is waited out (``on_wait(holder, at_most_s)``
        once), as the healthcheck calls a worker dead when its key expires, then replaced only if it still holds
        the beat first seen. How long a live holder can go between beats: a third of its TTL, which the key says
        (``ttl_s``; else the default TTL is assumed). A key that names no pid is no worker's heartbeat and is
        overwritten at once, as the keeper did before. One of this very host and pid (a container's PID 1
        restarted, or a twin container sharing the host's name) is watched only until its next beat was due, by
        this host's own clock: a restart need not wait for the key to expire.
        Returns what it did (``Claim``); ``took`` is False only when ``stop`` came first."""
        seen: dict | None = None
        seen_raw: bytes | str = ""
        give_up = 0.0
        while not stop.is_set():
            due = seen is not None and time.monotonic() >= give_up
            written, value = self._write({"phase": "starting"}, replaces=seen_raw if due else "")
            if written:  # free, no heartbeat, or the dead holder's last beat
                return Claim(True, parse_heartbeat(value) if value is not None else seen)
            holder = parse_heartbeat(value)
            if seen is None:
                seen, seen_raw = holder, value
                holder_ttl_s = _number(holder.get("ttl_s")) or DEFAULT_TTL_S
                at_most_s = max(self.ttl_s, holder_ttl_s) + 1.0  # a live holder beats 3 times within
                if (holder.get("host"), holder.get("pid")) == (self.info["host"], self.info["pid"]):
                    due_ms = _number(holder.get("beat_at_ms")) + (holder_ttl_s / 3.0 + 1.0) * 1000.0
                    at_most_s = min(at_most_s, max(due_ms - now_ms(), 0.0) / 1000.0)
                give_up = time.monotonic() + at_most_s
                if on_wait is not None and at_most_s > 0:
                    on_wait(holder, at_most_s)
            elif value != seen_raw:  # it beat again: alive
                raise NameInUse(holder)
            if time.monotonic() < give_up:
                stop.wait(poll_s)
        return Claim(False, seen)

    def leave_group(self, stream: str, group: str, consumer: str, client: redis.Redis | None = None) -> bool:
        """Remove ``consumer`` from ``group`` at exit, in one atomic step (scripts.LEAVE): only while no other
        process holds the name and it has nothing pending. True if removed. ``client``: as ``clear``'s."""
        return bool(leave_script(client or self.client, [self.key, stream], [self.instance, group, consumer]))

    def clear(self, client: redis.Redis | None = None) -> bool:
        """Delete the key at exit, unless another process has taken the name over; True if it was deleted (the
        name was still this process's). ``client``: another connection than the worker's (a cold exit's)."""
        return bool(release_script(client or self.client, [self.key], [self.instance]))


def parse_heartbeat(value: bytes | str | None) -> dict:
    """A heartbeat's JSON as a dict ({} for a value that is none: not JSON, not an object, another type)."""
    try:
        holder = json.loads(value) if value else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def is_worker_heartbeat(beat: dict) -> bool:
    """A worker wrote it (each names its pid): the rule of ``scripts.HEARTBEAT``, which overwrites anything else."""
    pid = beat.get("pid")
    return isinstance(pid, (int, float, str)) and not isinstance(pid, bool) and pid not in (0, "")


PHASE_BEAT_S = 1.0  # a change of phase is in the heartbeat within this; the keeper beats no more often for it


class Keeper(threading.Thread):
    """Keeps this worker's claims alive from its own thread, whatever the loop is doing:

    * the heartbeat key, every third of its TTL (two missed beats still leave it alive), and within
      ``PHASE_BEAT_S`` of a change of phase, never more often: ``status`` showed a phase up to a third of the TTL
      old (a worker "reading 8s" that had been inferring for seconds). The move out of "starting" is beaten at once;
    * the idle time of the entries it holds (``refresh``, every third of TRIAGE_CLAIM_IDLE_MS), so
      a prefetched window waiting for its turn, or a pass longer than the claim idle time, is not
      reclaimed by another worker. A frozen or dead process stops both, which is the point.

    A beat that finds another process's heartbeat under the name (this one was frozen past its TTL and the name
    was taken over) calls ``on_lost(holder)`` once and beats no more; ``lost`` keeps that holder."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        status: Status,
        *,
        refresh: Callable[[], object] | None,
        refresh_interval_s: float,
        log,
        on_lost: Callable[[dict], None] | None = None,
    ):
        super().__init__(name="triage-keeper", daemon=True)
        self.heartbeat = heartbeat
        self.status = status
        self.refresh = refresh
        self.beat_interval_s = heartbeat.ttl_s / 3.0
        self.refresh_interval_s = max(refresh_interval_s, 0.05)
        self.log = log
        self.on_lost = on_lost
        self.on_beat: Callable[[], object] | None = None  # after every beat (the loop's queue gauges)
        self._beats_failing = 0  # beats failed in a row: the first is a warning (health checks will fail)
        self.lost: dict | None = None
        self._stop_evt = threading.Event()
        self._wake = threading.Event()  # set by stop() and beat_soon()
        self._beat_due = False
        # a phase change not beaten yet: the key said "starting" a third of the TTL after the model loaded (meanwhile
        # `healthcheck --ready` failed a worker taking work), and any phase up to that old
        self._phase_due = False
        # the phase the last beat tried to write: the first move out of "starting" is beaten at once (it is what says
        # ready: `healthcheck --ready`, `status`), not PHASE_BEAT_S after the start-up beat; tried once, landed or
        # not, the limit holds again (a Redis refusing beats is not asked at every pass start)
        self._beaten_phase = "starting"
        status.on_moved = self._phase_moved

    def _phase_moved(self) -> None:
        self._phase_due = True
        self._wake.set()

    def beat_soon(self) -> None:
        """Beat now, not a third of the TTL from the last beat: the key is known gone (the group was recreated:
        FLUSHALL, a Redis restarted empty), and until the next beat healthchecks fail and ``status`` shows no worker."""
        self._beat_due = True
        self._wake.set()

    def run(self) -> None:
        next_beat = next_refresh = time.monotonic()
        last_beat = -PHASE_BEAT_S
        while True:
            now = time.monotonic()
            if now >= next_beat or self._beat_due or (self._phase_due and now >= self._phase_beat_at(last_beat)):
                self._beat_due = self._phase_due = False
                next_beat, last_beat = now + self.beat_interval_s, now
                self._beat()
                if self.on_beat is not None:
                    try:
                        self.on_beat()
                    except Exception as e:  # noqa: BLE001 - metrics only; Redis trouble shows up elsewhere
                        self.log.debug("on_beat_failed", error=f"{type(e).__name__}: {e}")
            if self.refresh is not None and now >= next_refresh:
                next_refresh = now + self.refresh_interval_s
                try:
                    self.refresh()
                except Exception as e:  # noqa: BLE001 - Redis down: the reader and the writer report it
                    self.log.debug("refresh_failed", error=f"{type(e).__name__}: {e}")
            wake = min(next_beat, next_refresh if self.refresh is not None else next_beat)
            if self._phase_due:
                wake = min(wake, self._phase_beat_at(last_beat))
            self._wake.wait(max(wake - time.monotonic(), 0.0))
            self._wake.clear()
            if self._stop_evt.is_set():
                return

    def _phase_beat_at(self, last_beat: float) -> float:
        """When a change of phase may be beaten: at once out of "starting", else PHASE_BEAT_S after the last beat."""
        return last_beat if self._beaten_phase == "starting" else last_beat + PHASE_BEAT_S

    def _beat(self) -> None:
        if self.lost is not None:  # the name is another process's now: never overwrite its key
            return
        try:
            snapshot = self.status.snapshot()
            self._beaten_phase = snapshot["phase"]
            self.lost = self.heartbeat.beat(**snapshot)
        except Exception as e:  # noqa: BLE001 - a missed beat is what the TTL is for
            self._beats_failing += 1
            level = self.log.warning if self._beats_failing == 1 else self.log.debug
            level("heartbeat_failed", error=f"{type(e).__name__}: {e}", failed_in_a_row=self._beats_failing)
            return
        if self._beats_failing:
            self.log.info("heartbeat_recovered", failed_in_a_row=self._beats_failing)
            self._beats_failing = 0
        if self.lost is not None and self.on_lost is not None:
            self.on_lost(self.lost)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop_evt.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout=timeout_s)


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def fresh_heartbeats(client: redis.Redis, key_prefix: str, consumer: str | None = None) -> Iterator[tuple[str, dict]]:
    """(consumer, heartbeat JSON) for each live worker heartbeat (one consumer's if given). Another key under the
    prefix (another type, not a JSON object, no pid: a leftover, a prefix shared with other keys) is none: it must
    neither keep a dead deployment healthy nor fail every probe."""
    keys = [key_prefix + consumer] if consumer else keys_under(client, key_prefix, count=500)
    for key in keys:
        try:
            raw = client.get(key)
        except redis.ResponseError as e:
            if error_code(e) == "WRONGTYPE":
                continue
            raise
        beat = parse_heartbeat(raw)
        if is_worker_heartbeat(beat):
            yield (key.decode() if isinstance(key, bytes) else key)[len(key_prefix) :], beat


def of_group(beat: dict, stream: str, group: str) -> bool:
    """A heartbeat of a worker reading ``stream`` in ``group`` (one without these fields: an older worker, counted):
    what ``status`` lists and ``healthcheck`` counts when no consumer is named."""
    return beat.get("stream", stream) == stream and beat.get("group", group) == group


def is_ready(beat: dict) -> bool:
    """Past start-up (model loaded, loop running): any phase but ``starting``; a heartbeat without one counts."""
    return beat.get("phase") != "starting"
