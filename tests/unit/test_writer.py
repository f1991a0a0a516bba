"""worker.stream.writer.Writer: writes in order on its own thread; ``close`` writes what is queued, then stops.
Pure (the commit is a stand-in: what is tested is the queue and the thread)."""

from __future__ import annotations

import threading

from worker.stream.metrics import WindowMetrics
from worker.stream.sink import Outcome
from worker.stream.writer import PassWrite, WindowJob, Writer


def _job(n: int) -> WindowJob:
    return WindowJob(window=None, metrics=WindowMetrics(window=n))  # type: ignore[arg-type]


def _write(n: int, last: bool = True) -> PassWrite:
    return PassWrite(_job(n), Outcome(ack_ids=[f"{n}-0"]), last=last)


def _closing(writer: Writer) -> threading.Thread:
    closer = threading.Thread(target=writer.close, daemon=True)
    closer.start()
    return closer


def test_close_writes_everything_queued_in_order_then_stops():
    written, done = [], []
    release = threading.Event()

    def commit(outcome, window):
        release.wait()
        written.append(outcome.ack_ids[0])
        return outcome

    w = Writer(commit, on_written=lambda job, out: None, on_window_done=lambda job: done.append(job.metrics.window))
    w.start()
    for n in range(3):  # one in progress, two queued: the queue is full
        w.put(_write(n))
    closer = _closing(w)
    release.set()
    closer.join(10)
    assert not closer.is_alive() and not w.is_alive() and w.failed is None
    assert written == ["0-0", "1-0", "2-0"] and done == [0, 1, 2]


def test_close_returns_when_the_write_in_progress_fails_with_the_queue_full():
    """A failed writer drains nothing: before, ``close`` waited forever for room in its queue (a wedge at a warm
    stop: heartbeats went on, the entries stayed pending on a live consumer)."""
    started, release = threading.Event(), threading.Event()

    def commit(outcome, window):
        started.set()
        release.wait()
        raise RuntimeError("WRONGTYPE Operation against a key holding the wrong kind of value")

    w = Writer(commit, on_written=lambda job, out: None, on_window_done=lambda job: None)
    w.start()
    w.put(_write(0))
    started.wait(10)
    w.put(_write(1))
    w.put(_write(2))  # queue full behind the write in progress
    closer = _closing(w)
    release.set()
    closer.join(10)
    assert not closer.is_alive(), "close() is stuck on a full queue behind a failed writer"
    assert isinstance(w.failed, RuntimeError) and not w.is_alive()
