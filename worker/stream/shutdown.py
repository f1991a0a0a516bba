"""rq-style warm/cold shutdown on SIGTERM/SIGINT.

First signal (warm): stop reading, finish and ack what was already read, exit 0.
Second signal (cold): exit at once; whatever was read but not acked stays in the
consumer group's pending list, where another worker reclaims it (XAUTOCLAIM).
Exiting mid-write is safe: the settle script (scripts.py) ran entirely or not at all.
Before a cold exit ``before_cold_exit`` runs (the worker releases its heartbeat there, so status
and healthcheck call it dead at once, not a TTL later, and a restart may take its name).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Shutdown:
    def __init__(self, log):
        self.log = log
        self.stop = threading.Event()
        self.signals = 0
        self.reason: str | None = None
        self.failure: tuple[str, int] | None = None  # (reason, exit code) of a stop that must not exit 0
        self.before_cold_exit: Callable[[], None] | None = None  # quick, and on connections of its own

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def request(self, reason: str, exit_code: int = 0) -> None:
        """Warm stop from code (e.g. --drain finished; the consumer name lost: exit 2). A non-zero stop wins over
        any warm one, before or after it (a SIGTERM sent to a frozen worker is delivered on SIGCONT, as its keeper
        finds the name lost); it has an attribute of its own, so a signal handler interrupting this never undoes it."""
        if exit_code:
            self.failure = (reason, exit_code)
        elif self.reason is None:
            self.reason = reason
        self.stop.set()

    def outcome(self, code: int, why: str) -> tuple[int, str]:
        """(exit code, reason) to stop with: a requested failure's, else the caller's."""
        if self.failure is not None and code == 0:
            return self.failure[1], self.failure[0]
        return code, why

    def _handle(self, signum: int, _frame) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            self.log.info("warm_shutdown", signal=name, note="finishing the batch in hand; send again to exit at once")
            self.request(f"signal {name}")
            return
        try:  # whatever happens here (a log write interrupted mid-write raises "reentrant call"), the exit happens
            self.log.warning("cold_shutdown", signal=name, note="exiting now; unacked entries stay pending for reclaim")
            if self.before_cold_exit is not None:
                try:
                    self.before_cold_exit()
                except Exception as e:  # noqa: BLE001 - exiting anyway: the heartbeat then expires by its TTL
                    self.log.warning("cold_shutdown_release_failed", error=f"{type(e).__name__}: {e}")
            for stream in (sys.stderr, sys.stdout):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
        finally:
            os._exit(128 + signum)
