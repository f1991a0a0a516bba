"""RQ's worker loop through a Redis that refuses it for now (out of memory under noeviction, a restart, a replica not
promoted yet, a script running): waited out with the stream worker's backoff and log lines, not a quit.

Why: RQ's dequeue retries only ConnectionError and TimeoutError; anything else raised in its loop (a refused
heartbeat, BLMOVE, state write) ends the worker ("found an unhandled exception, quitting"), its refused
register_death then makes ``rq worker`` exit 1, and a supervisor restarts it into the same error. Redis 7 also
refuses every command queued in a MULTI at maxmemory, reads too (RQ's suspension check). ``RedisWaits``, mixed in
before ``BaseWorker``:

* ``until_written``: an operation tried again until Redis takes it, one ``redis_unavailable`` line per try, then
  ``redis_reconnected``; RQ's suspension check, maintenance and dequeue wait that way (op ``rq_dequeue``);
* the worker's presence writes outside a pipeline (its state field, a heartbeat, the shutdown date) are skipped when
  refused: RQ reads the state in memory, they are written again soon (the batch's start, the next dequeue), and the
  operation that meets the refusal next logs it. Raised, they ended the loop with a job in hand;
* a stop whose register_death is refused is logged and still exits 0: the worker's key expires by itself;
* the start's ``register_birth``, right after the model loads, is waited out too (op ``rq_birth``): raised, ``rq
  worker`` exited 1 and a supervisor's restart loaded the model again. RQ installs its signal handlers only after
  the start, so a SIGTERM then killed the process: during this wait a warm stop ends the start, exit 0.
  ``rq worker``'s own suspension check, before the worker class is even made, is RQ's CLI (docs/rq.md).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TypeVar

from rq.utils import utcformat
from rq.worker import BaseWorker

from worker.observability import prometheus
from worker.stream.connection import Backoff, is_passing

T = TypeVar("T")


class RedisWait:
    """One operation's wait: a ``redis_unavailable`` line per refused try (then the backoff's sleep), and
    ``redis_reconnected`` once it goes through."""

    def __init__(self, worker: BaseWorker, op: str):
        self.worker, self.op = worker, op
        self.backoff: Backoff | None = None

    def failed(self, e: BaseException, stop: threading.Event | None = None) -> None:
        """Log the refusal ``e`` and sleep the next delay (cut short once ``stop`` is set); raises ``e`` if it does not
        pass by itself."""
        if not is_passing(e):
            raise e
        self.backoff = self.backoff or Backoff(self.worker.settings.reconnect_max_s)
        delay = self.backoff.failed(stop)  # a signal's handler still runs (a warm stop raises StopRequested here)
        self.worker.tlog.warning(
            "redis_unavailable",
            op=self.op,
            error=f"{type(e).__name__}: {e}",
            attempt=self.backoff.attempt,
            retried_after_s=round(delay, 2),
        )

    def passed(self) -> None:
        if self.backoff is not None:
            # counted first (triage_redis_reconnects_total, as the stream worker counts them): whoever sees the line
            # then finds it counted
            prometheus.current().reconnected()
            self.worker.tlog.info("redis_reconnected", op=self.op, attempts=self.backoff.attempt)
            self.backoff = None


class StopBeforeStart(Exception):
    """A warm stop while the start loaded the model or waited for Redis to take the worker's registration: it never
    registered."""


@contextlib.contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """For the block: SIGINT/SIGTERM set the event (a second one exits at once), as ``register_birth`` waits. RQ
    installs its own handlers only once its loop starts: a stop while the model loaded killed the process."""
    stop = threading.Event()
    undo = _stop_signals_set(stop)
    try:
        yield stop
    finally:
        undo()


def _stop_signals_set(stop: threading.Event) -> Callable[[], None]:
    """Until the returned undo: SIGINT/SIGTERM set ``stop``, a second one exits at once (RQ's cold stop). Only a flag:
    raised in the middle of a registration, a stop could leave it applied with no death registered."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def requested(signum, frame) -> None:
        if stop.is_set():
            raise SystemExit()
        stop.set()

    previous = {s: signal.signal(s, requested) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


@functools.cache
def _stay_stopped_at_exit() -> None:
    """``_stay_stopped`` at the process's exit, registered once however many times the worker runs."""
    atexit.register(_stay_stopped)


def _stay_stopped() -> None:
    """At the process's exit, after the work loop ended: SIGINT/SIGTERM ignored. The interpreter's teardown (~1.6 s
    with torch loaded) resets a Python handler to the default, so a second signal then (docker stop and Ctrl-C, tini
    -g) killed a worker whose work was done and recorded (-15, a --burst job failed); it keeps an ignored one."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def _skipped_if_refused(write: Callable[[], object]) -> None:
    try:
        write()
    except Exception as e:  # noqa: BLE001 - only what passes by itself is skipped
        if not is_passing(e):
            raise


class RedisWaits(BaseWorker):
    """BaseWorker's loop steps, waiting out a Redis that refuses them (see the module doc)."""

    def until_written(self, record: Callable[[], T], op: str = "rq_record") -> T:
        """``record()`` again while Redis refuses writes it will take later; its result. Raised, RQ's worker quit:
        jobs taken but not started stayed in the intermediate list until RQ's cleanup failed them as stuck; started
        ones until its registry cleanup failed them as abandoned (a failure callback then ran twice). ``record`` must
        be safe to call again: a refused MULTI/EXEC (an error reply) applies nothing; one whose reply was lost (the
        connection dropped) may have been applied, and is checked first (``landing``). A second signal (cold stop)
        still ends it."""
        wait = RedisWait(self, op)
        while True:
            try:
                out = record()
            except Exception as e:  # noqa: BLE001 - failed() raises what does not pass by itself
                wait.failed(e)
                continue
            wait.passed()
            return out

    def work(self, *args, **kwargs) -> bool:
        try:
            return super().work(*args, **kwargs)
        except StopBeforeStart:  # raised by register_birth, before RQ's loop (and its teardown) ran
            self.log.info("Worker %s: stopping on request before it started", self.name)
            return False
        finally:
            _stay_stopped_at_exit()

    def register_birth(self) -> None:
        """RQ's, tried again while Redis refuses it (see the module doc); raises StopBeforeStart on a warm stop. A try
        whose reply was lost may have registered the worker: RQ's own check would take that for another live worker
        of this name (exit 1), so the birth dates of earlier tries are looked for first."""
        stop = threading.Event()
        undo = _stop_signals_set(stop)
        wait = RedisWait(self, "rq_birth")
        tried: dict[bytes, datetime] = {}  # the birth date of each try that sent its transaction, as RQ writes it
        try:
            while not stop.is_set():
                try:
                    self._register_once(tried)
                except Exception as e:  # noqa: BLE001 - failed() raises what does not pass by itself
                    wait.failed(e, stop)
                    continue
                wait.passed()
                if stop.is_set():  # during the try that went through: RQ's loop ends at its first check
                    self._stop_requested = True
                return
        finally:
            undo()
        self.handle_warm_shutdown_request()
        raise StopBeforeStart

    def _register_once(self, tried: dict[bytes, datetime]) -> None:
        """RQ's register_birth, unless an earlier try whose reply was lost was applied (any of them: each has its own
        birth date): seen before RQ's check, or (reaching Redis late) by it, whose "There exists an active worker
        named ..." is then this worker's own."""
        if tried and self._birth_landed(tried):
            return
        try:
            super().register_birth()
        except ValueError:
            if not self._birth_landed(tried):  # (none tried: the key is another live worker's)
                raise
        finally:
            if self.birth_date is not None:  # set by RQ right before its transaction
                tried[utcformat(self.birth_date).encode()] = self.birth_date

    def _birth_landed(self, tried: dict[bytes, datetime]) -> bool:
        birth, death = self.connection.hmget(self.key, "birth", "death")
        if death is not None or birth not in tried:
            return False
        self.birth_date = tried[birth]
        return True

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        """RQ's, tried again after a refusal RQ's loop does not retry: it raised before a job was taken (a job RQ
        popped and could not read carries its id and is the caller's). A strict heartbeat shows Redis takes writes
        again before the next try."""
        wait = RedisWait(self, "rq_dequeue")
        while True:
            try:
                if wait.backoff is not None:
                    super().heartbeat()
                    wait.passed()
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as e:
                if getattr(e, "job_id", None) is not None:
                    raise
                wait.failed(e)

    def check_for_suspension(self, burst: bool) -> None:
        self.until_written(functools.partial(super().check_for_suspension, burst), op="rq_dequeue")

    def run_maintenance_tasks(self) -> None:
        self.until_written(super().run_maintenance_tasks, op="rq_dequeue")

    def set_state(self, state: str, pipeline=None) -> None:
        if pipeline is not None:
            return super().set_state(state, pipeline)
        _skipped_if_refused(functools.partial(super().set_state, state))  # RQ sets it in memory first

    def heartbeat(self, timeout: int | None = None, pipeline=None) -> None:
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline)
        _skipped_if_refused(functools.partial(super().heartbeat, timeout))

    def set_shutdown_requested_date(self) -> None:
        """Written by RQ's signal handler: raised there, the refusal would surface in whatever ran (a forward pass)."""
        _skipped_if_refused(super().set_shutdown_requested_date)

    def teardown(self) -> None:
        try:
            super().teardown()
        except Exception as e:  # noqa: BLE001 - only what passes by itself is tolerated
            if not is_passing(e):
                raise
            self.tlog.warning(
                "redis_unavailable",
                op="rq_stop",
                error=f"{type(e).__name__}: {e}",
                note="the worker's death is not registered; its key expires by itself (worker_ttl + 60 s)",
            )
            with contextlib.suppress(Exception):
                self.unsubscribe()
