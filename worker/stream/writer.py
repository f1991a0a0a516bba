"""The writer thread: writes each pass's results (and acks) in order, while the model runs the next pass.

Why a thread: at GPU speed a pass takes milliseconds, the same order as a Redis round trip;
writing on the main thread would leave the GPU idle for every write. The queue is bounded
(``max_queued`` passes), so the model is never more than that far ahead of Redis, and a
Redis outage stops the model after that many passes instead of piling results up in memory.
One thread, one FIFO queue: writes happen in the order the passes ran, with the same
ownership and retry rules as before (``commit``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.stream.metrics import WindowMetrics
from worker.stream.sink import Outcome
from worker.stream.window import Window


class WriterFailed(RuntimeError):
    """The writer stopped on an error the worker must not continue after (see ``Writer.failed``)."""


@dataclass
class WindowJob:
    """A window on its way through the passes and writes; settled after its last write."""

    window: Window
    metrics: WindowMetrics
    dropped: bool = False  # its consumer group was lost: later writes of this window are skipped


@dataclass
class PassWrite:
    job: WindowJob
    outcome: Outcome = field(default_factory=Outcome)
    last: bool = False  # the window's last write: settle the window after it


class Writer(threading.Thread):
    def __init__(
        self,
        commit: Callable[[Outcome, Window], Outcome | None],
        *,
        on_written: Callable[[WindowJob, Outcome], None],
        on_window_done: Callable[[WindowJob], None],
        max_queued: int = 2,
    ):
        super().__init__(name="triage-writer", daemon=True)
        self.commit = commit  # write + ack what is still ours, retrying; None if the group was lost
        self.on_written = on_written
        self.on_window_done = on_window_done
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.failed: BaseException | None = None

    def put(self, item: PassWrite, on_wait: Callable[[], None] | None = None) -> None:
        """Queue a write; blocks while ``max_queued`` writes wait (calls ``on_wait`` once if it has to)."""
        waited = False
        while True:
            if self.failed is not None:
                raise WriterFailed(str(self.failed)) from self.failed
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                if not waited and on_wait is not None:
                    on_wait()
                waited = True

    def close(self) -> None:
        """Write everything queued, then stop (blocks; a write that keeps failing keeps retrying). Returns if the
        writer fails meanwhile (``failed``): a full queue is never drained then, so the stop is offered in turns."""
        while self.is_alive():
            try:
                self._queue.put(None, timeout=0.2)
            except queue.Full:
                continue
            self.join()
            return

    def run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(item)
            except BaseException as e:  # noqa: BLE001 - the main loop stops on it
                self.failed = e
                return

    def _write(self, item: PassWrite) -> None:
        job = item.job
        if not job.dropped and item.outcome:
            t0 = time.perf_counter()
            written = self.commit(item.outcome, job.window)
            job.metrics.write_ms += (time.perf_counter() - t0) * 1000
            if written is None:
                job.dropped = True
            else:
                self.on_written(job, written)
        if item.last:
            self.on_window_done(job)
