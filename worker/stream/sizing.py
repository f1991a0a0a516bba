"""How many tickets the next window may take: about ``target_s`` seconds of the model's measured work.

Why not always ``TRIAGE_WINDOW_MAX_ITEMS``: a window's entries are pending on this worker until they
are written, so a fixed count is a fixed amount of *work*, not of *time*. On a CPU at 4 tickets/s a
256-ticket window is a minute: one worker takes a small backlog while its replicas idle, and a
SIGTERM waits for all of it. On a GPU at thousands of tickets/s the same 256 is a few milliseconds,
too little to amortise a window's reads and writes. Sizing by measured rate gives both the same
bound in seconds. Pure: no Redis, no clock (the loop feeds it the work each window took).
"""

from __future__ import annotations

import threading

PROBE_ITEMS = 16  # the first window's size: small, its job is to measure the rate


class WindowSizer:
    """``cap()``: the most tickets the next read asks for (0: wait); ``read()``: a window was read with it;
    ``observe()``: what a window's passes cost; ``settled()``: a window is done (written, or dropped).

    ``target_s == 0`` switches sizing off (every window asks for ``max_items``). Until a rate is measured
    one small probe window is out at a time (``cap()`` says 0 while it is, so the reader does not prefetch
    a second window of unknown size). The rate is smoothed over windows (``smoothing`` = weight of the
    newest), so one odd window does not swing the size."""

    def __init__(
        self,
        target_s: float,
        max_items: int,
        probe_items: int = PROBE_ITEMS,
        smoothing: float = 0.5,
        ramp_items: int = 0,
    ):
        if target_s < 0 or max_items < 1 or probe_items < 1 or not 0 < smoothing <= 1 or ramp_items < 0:
            raise ValueError(
                f"bad sizing: target_s={target_s}, max_items={max_items}, probe_items={probe_items}, "
                f"smoothing={smoothing}, ramp_items={ramp_items}"
            )
        self.target_s = target_s
        self.max_items = max_items
        self.probe_items = min(probe_items, max_items)
        self.smoothing = smoothing
        self.ramp_items = ramp_items  # 0: no ramp
        self.items_per_s: float | None = None  # measured: tickets per second of model work
        self._probe_out = False
        self._last_read = 0  # tickets in the window read last; 0 after a read that found nothing
        self._lock = threading.Lock()  # the writer thread observes, the reader thread asks

    @classmethod
    def for_worker(cls, settings, clf) -> WindowSizer:
        """The stream worker's: windows of about TRIAGE_WINDOW_TARGET_S of measured work, after a small probe
        window, each at most twice the one before, never over the window cap (its CUDA default on a GPU)."""
        from worker.assemble import window_max_items

        max_items = window_max_items(settings, getattr(clf, "device", None))
        return cls(settings.window_target_s, max_items, ramp_items=settings.window_ramp_items)

    def cap(self) -> int:
        with self._lock:
            cap = self._sized()
            if self.ramp_items and cap:  # at most twice the last window: see ``read``
                cap = min(cap, max(self.ramp_items, 2 * self._last_read))
            return cap

    def _sized(self) -> int:
        if self.target_s == 0:
            return self.max_items
        if self.items_per_s is not None:
            return max(1, min(self.max_items, int(self.items_per_s * self.target_s)))
        return 0 if self._probe_out else self.probe_items

    def read(self, items: int) -> None:
        """A window of ``items`` tickets was read (a read that found nothing is not one, see ``idle``): before a
        rate is known, it is the probe.

        The ramp: a window takes at most twice the tickets of the one before, and ``ramp_items`` after start-up
        or an empty read. The model starts on a burst once a few hundred tickets are read and tokenized, not
        thousands (nothing overlaps the first window's read), and the reader still keeps ahead: it reads the
        next window, at most twice as large, while the model runs this one."""
        with self._lock:
            self._last_read = items
            if self.target_s and self.items_per_s is None:
                self._probe_out = True

    def idle(self) -> None:
        """A read found nothing: the next burst starts the ramp again."""
        with self._lock:
            self._last_read = 0

    def observe(self, items: int, work_ms: float) -> None:
        """A window classified ``items`` tickets in ``work_ms`` of model work (its passes); empty ones say nothing."""
        if items <= 0 or work_ms <= 0:
            return
        rate = items * 1000.0 / work_ms
        with self._lock:
            old = self.items_per_s
            self.items_per_s = rate if old is None else old + self.smoothing * (rate - old)

    def settled(self) -> None:
        """A window is written or dropped: without a rate yet, the next probe may go out."""
        with self._lock:
            self._probe_out = False
