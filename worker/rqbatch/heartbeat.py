"""Heartbeats while a batch runs, as RQ's forking Worker sends them while its work horse runs.

Why a thread: the forward pass holds the main thread for as long as the batch takes
(its timeout is the sum of its jobs' timeouts). Without heartbeats the batch's
Executions would need a TTL that long, and a worker killed mid-batch would leave
its jobs "started" for that long. With them, every TTL stays at
job_monitoring_interval + 60 s, and RQ's registry cleanup finds a dead worker's
jobs (and fails or retries them) within about a minute and a half.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rq.worker import BaseWorker

    from worker.rqbatch.jobs import Entry

log = logging.getLogger("triage.rq")


class BatchHeartbeat:
    def __init__(self, worker: BaseWorker, entries: list[Entry], on_beat: Callable[[], None] | None = None):
        self.worker = worker
        self.entries = entries
        self.on_beat = on_beat  # e.g. the metrics phase, which a signal handler must not touch
        self.interval_s = max(1, int(worker.job_monitoring_interval))
        self.ttl_s = self.interval_s + 60
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rq-batch-heartbeat", daemon=True)

    def __enter__(self) -> BatchHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                if self.on_beat is not None:
                    self.on_beat()
            except Exception as e:  # a missed beat is retried next interval; the batch goes on
                log.warning("rq batch heartbeat failed: %s", e)

    def beat(self) -> None:
        """Refresh the worker key and every started execution of the batch (RQ's maintain_heartbeats, batched)."""
        with self.worker.connection.pipeline() as pipe:
            self.worker.heartbeat(self.ttl_s, pipeline=pipe)
            for e in self.entries:
                if e.execution is not None and not e.recorded:
                    e.execution.heartbeat(e.job.started_job_registry, self.ttl_s, pipeline=pipe)
            pipe.execute()
