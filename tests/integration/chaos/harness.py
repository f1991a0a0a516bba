"""What every chaos test needs: sizes (quick/full), pushing tickets, counting results
(lost / duplicates), waiting, RSS sampling, and publishing figures.

Sizes: ``TRIAGE_CHAOS_SCALE=full`` switches every test to the issue's full size
(>= 5,000 tickets with >= 20 kills, 100,000-entry backlog, ...); the default
"quick" size keeps ``make test`` within its budget on a 2-core box.
``TRIAGE_CHAOS_REPORT=<file>`` makes each test append its figures (one JSON
object per line) for ``scripts/chaos_report.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.integration.chaos.redis_server import read_rss_kb

SCALE = os.environ.get("TRIAGE_CHAOS_SCALE", "quick").strip().lower()  # quick | full
FULL = SCALE == "full"


def sized(quick, full):
    """The quick value (``make test``), or the full one with TRIAGE_CHAOS_SCALE=full (scripts/chaos_report.py)."""
    return full if FULL else quick


# ---------------------------------------------------------------------- tickets
def synth_tickets(n: int, seed: int = 0, prefix: str = "t") -> list[dict[str, str]]:
    """``n`` realistic tickets (producer/synth.py) with unique ids ``<prefix>-<i>``."""
    from producer.synth import generate_tickets

    return [{"id": f"{prefix}-{i}", "text": t["text"]} for i, t in enumerate(generate_tickets(n, seed))]


def push(client: redis.Redis, stream: str, entries: Iterable[dict], *, chunk: int = 1000) -> list[str]:
    """XADD every entry (fields as given; bytes stay bytes), pipelined; the stream ids in order."""
    ids: list[str] = []
    pipe = client.pipeline(transaction=False)
    n = 0
    for fields in entries:
        pipe.xadd(stream, fields)
        n += 1
        if n % chunk == 0:
            ids += [_s(i) for i in pipe.execute()]
    ids += [_s(i) for i in pipe.execute()]
    return ids


def read_stream(client: redis.Redis, stream: str, *, page: int = 5000) -> Iterator[tuple[str, dict[str, str]]]:
    """Every entry of ``stream`` (XRANGE pages), fields decoded leniently."""
    start = "-"
    while True:
        rows = client.xrange(stream, min=start, max="+", count=page)
        if not rows:
            return
        for sid, fields in rows:
            yield _s(sid), {_s(k): _s(v) for k, v in fields.items()}
        start = "(" + _s(rows[-1][0])


def _s(v) -> str:
    return v.decode("utf-8", errors="backslashreplace") if isinstance(v, bytes) else str(v)


# ---------------------------------------------------------------------- tallies
@dataclass
class Tally:
    """Results and dead letters per ticket id, against the ids that were pushed."""

    expected: list[str]
    results: Counter = field(default_factory=Counter)  # ticket id -> result records
    dead: Counter = field(default_factory=Counter)  # ticket id (or stream id) -> dead-letter records
    labels: Counter = field(default_factory=Counter)
    workers: Counter = field(default_factory=Counter)  # consumer name -> results written
    first_ms: int | None = None
    last_ms: int | None = None

    @property
    def done(self) -> set[str]:
        return set(self.results) | set(self.dead)

    @property
    def lost(self) -> list[str]:
        done = self.done
        return [i for i in self.expected if i not in done]

    @property
    def duplicates(self) -> int:
        """Extra records beyond the first, results and dead letters together."""
        return sum(c - 1 for c in self.results.values() if c > 1) + sum(c - 1 for c in self.dead.values() if c > 1)

    @property
    def duplicated_ids(self) -> int:
        return sum(1 for c in self.results.values() if c > 1) + sum(1 for c in self.dead.values() if c > 1)

    def throughput(self) -> float | None:
        """Results per second between the first and last ``classified_at_ms``."""
        if not self.first_ms or self.last_ms == self.first_ms:
            return None
        return sum(self.results.values()) / ((self.last_ms - self.first_ms) / 1000.0)


def tally(client: redis.Redis, results_stream: str, dead_stream: str, expected: list[str]) -> Tally:
    t = Tally(expected=list(expected))
    for _sid, f in read_stream(client, results_stream):
        t.results[f.get("id", "?")] += 1
        t.labels[f.get("label", "?")] += 1
        t.workers[f.get("worker", "?")] += 1
        at = int(f.get("classified_at_ms", "0") or 0)
        t.first_ms = at if t.first_ms is None else min(t.first_ms, at)
        t.last_ms = at if t.last_ms is None else max(t.last_ms, at)
    for _sid, f in read_stream(client, dead_stream):
        t.dead[f.get("id") or f.get("stream_id", "?")] += 1
    return t


# ---------------------------------------------------------------------- waiting
def wait_until(
    pred: Callable[[], object],
    timeout_s: float,
    *,
    interval_s: float = 0.2,
    what: str = "condition",
    explain: Callable[[], str] | None = None,
    alive: Iterable = (),
):
    """Poll ``pred`` until it returns something truthy (returned); AssertionError after ``timeout_s``, with what
    ``explain`` says (the worker's last log lines, the group's state) so a rare hang can be read from CI.

    ``alive``: workers (WorkerProc) that must keep running meanwhile; one that exits fails the wait at once, with
    its exit code and last log lines, instead of a timeout that cannot tell a dead worker from a stuck one."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        for w in alive:
            if w.returncode is not None:
                raise AssertionError(f"worker exited ({w.returncode}) while waiting for {what}:\n{w.stderr_tail(60)}")
        if time.monotonic() > deadline:
            detail = ""
            if explain is not None:
                try:
                    detail = "\n" + explain()
                except Exception as e:  # the explanation must not hide the timeout
                    detail = f"\n(explain failed: {e!r})"
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{detail}")
        time.sleep(interval_s)


def count_done(client: redis.Redis, results_stream: str, dead_stream: str) -> int:
    return int(client.xlen(results_stream)) + int(client.xlen(dead_stream))


def pending_of(client: redis.Redis, stream: str, group: str) -> dict[str, int]:
    """consumer name -> entries pending on it (XPENDING summary)."""
    try:
        info = client.xpending(stream, group)
    except redis.ResponseError:
        return {}
    return {_s(c["name"]): int(c["pending"]) for c in (info.get("consumers") or [])}


# ---------------------------------------------------------------------- memory
class RssSampler(threading.Thread):
    """Samples a process's VmRSS (kB) every ``interval_s`` with a progress value, until stopped or the process exits."""

    def __init__(self, pid: int, interval_s: float = 0.5, progress: Callable[[], int] | None = None):
        super().__init__(name="rss-sampler", daemon=True)
        self.pid = pid
        self.interval_s = interval_s
        self.progress = progress or (lambda: 0)
        self.samples: list[tuple[float, int, int]] = []  # (t_s, rss_kb, progress)
        self._stop_evt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._stop_evt.is_set():
            rss = read_rss_kb(self.pid)
            if rss is None:
                return
            try:
                done = self.progress()
            except Exception:  # noqa: BLE001 - progress is informative only
                done = -1
            self.samples.append((time.monotonic() - t0, rss, done))
            self._stop_evt.wait(self.interval_s)

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop_evt.set()
        self.join(timeout=5)
        return self.samples


# ---------------------------------------------------------------------- figures
def record(test: str, **figures) -> dict:
    """Publish a test's figures: printed (visible with -s) and appended to $TRIAGE_CHAOS_REPORT if set."""
    row = {"test": test, "scale": SCALE, **figures, "load_avg_1m": round(os.getloadavg()[0], 1)}
    print(f"\nCHAOS {json.dumps(row, sort_keys=True)}")
    path = os.environ.get("TRIAGE_CHAOS_REPORT")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return row
