"""Progress of long offline runs (eval, fit, verify): a tqdm bar for a person at a terminal,
``progress`` log lines everywhere else.

Why: tqdm disables itself when stderr is not a terminal (CI, ``nohup``, a container log), so
a 20-minute eval said nothing at all until its end; and a bar drawn into a JSON log breaks
every line after it. Off a terminal (or with JSON logs) this logs one line through the
process's log chain every ``every_frac`` of the work or ``every_s`` seconds, and a last one.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "ticket",
        enabled: bool = True,
        leave: bool = True,
        stream: TextIO | None = None,
        every_s: float = 30.0,
        every_frac: float = 0.1,
    ):
        from worker import logs

        self.total, self.desc, self.unit, self.enabled = int(total), desc, unit, enabled
        self.stream = stream or sys.stderr
        self.every_s, self.step = every_s, max(1, int(total * every_frac))
        self.done = 0
        self._bar = None
        isatty = getattr(self.stream, "isatty", None)
        if enabled and isatty is not None and isatty() and not logs.json_mode():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream, leave=leave)
        self._log = logs.get_logger("triage.progress") if enabled and self._bar is None else None
        self._t0 = self._last_t = time.monotonic()
        self._last_done = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._log is not None:
            now = time.monotonic()
            if self.done - self._last_done >= self.step or now - self._last_t >= self.every_s:
                self._emit(now)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._log is not None and self.done != self._last_done:
            self._emit(time.monotonic())
        self._log = None

    def _emit(self, now: float) -> None:
        elapsed = now - self._t0
        rate = self.done / elapsed if elapsed > 0 else None
        left = (self.total - self.done) / rate if rate else None
        self._log.info(
            "progress",
            task=self.desc,
            done=self.done,
            total=self.total,
            unit=self.unit,
            pct=round(100.0 * self.done / self.total, 1) if self.total else None,
            elapsed_s=round(elapsed, 1),
            per_s=round(rate, 2) if rate else None,
            eta_s=round(left, 1) if left is not None else None,
        )
        self._last_t, self._last_done = now, self.done
