"""The numbers behind the log lines: one ``window`` line per drained window, one ``pass`` line per
forward call, and the periodic ``summary``. Pure: no Redis, no logging.

One canonical line per window (every field an operator needs to tell "slow model" from
"padding waste" from "backlog growing" without a second tool); the engine's own ``RunStats``
carries the pass counters, so they are not copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.types import RunStats, padding_pct, percentile


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def _device_ms(stats: RunStats) -> float | None:
    """The passes' device time (CUDA events), rounded; None off CUDA."""
    return _r(stats.gpu_ms) if stats.gpu_ms else None


def pass_line(window: int, index: int, stats: RunStats, *, split_retries: int = 0) -> dict:
    """The "pass" log record: one planned forward call of a window (``stats`` covers it; after a failure,
    the calls that re-ran its tickets one by one)."""
    return {
        "window": window,
        "pass": index,
        "items": stats.items,
        "real_tokens": stats.real_tokens,
        "padded_tokens": stats.padded_tokens,
        "padding_pct": round(stats.padding_pct, 1),
        "prefix_tokens_reused": stats.prefix_tokens_reused,
        "infer_ms": _r(stats.infer_ms),
        "gpu_ms": _device_ms(stats),  # CUDA: device time (infer_ms spans the pass before)
        "split_retries": split_retries,
    }


@dataclass
class WindowMetrics:
    """What one drained window cost; ``line()`` is the canonical "window" log record."""

    window: int  # sequence number in this process
    source: str = "new"  # new | pending | claimed
    stats: RunStats = field(default_factory=RunStats)  # the window's passes, added up (the engine's type)
    items: int = 0  # tickets classified and written
    dead_lettered: int = 0
    read_ms: float = 0.0
    tokenize_ms: float = 0.0
    write_ms: float = 0.0  # all the window's writes (results + acks), summed
    latencies_ms: list[float] = field(default_factory=list)
    backlog: int | None = None  # undelivered entries (XINFO GROUPS lag)
    pending: int | None = None  # delivered, not yet acked (whole group)
    split_retries: int = 0  # tickets re-run alone after a pass failed
    cap_items: int = 0  # the most tickets the window could take (TRIAGE_WINDOW_TARGET_S sizing)
    first_pass_early: bool = False  # its first pass was queued while the window before finished (lookahead)

    @property
    def model_ms(self) -> float:
        """The model's work: on CUDA its device time (with the lookahead the passes' wall times overlap), else
        ``infer_ms``."""
        return self.stats.gpu_ms or self.stats.infer_ms

    @property
    def busy_ms(self) -> float:
        """Work done for this window (tokenize + infer + write), not counting waits for tickets to arrive."""
        return self.tokenize_ms + self.stats.infer_ms + self.write_ms

    @property
    def items_per_s(self) -> float:
        done = self.items + self.dead_lettered
        return 1000.0 * done / self.busy_ms if self.busy_ms > 0 else 0.0

    def line(self) -> dict:
        st = self.stats
        return {
            "window": self.window,
            "source": self.source,
            "items": self.items,
            "dead_lettered": self.dead_lettered,
            "passes": st.passes,
            "real_tokens": st.real_tokens,
            "padded_tokens": st.padded_tokens,
            "padding_pct": round(st.padding_pct, 1),
            "prefix_tokens_reused": st.prefix_tokens_reused,
            "read_ms": _r(self.read_ms),
            "tokenize_ms": _r(self.tokenize_ms),
            "infer_ms": _r(st.infer_ms),
            "gpu_ms": _device_ms(st),
            "write_ms": _r(self.write_ms),
            "items_per_s": _r(self.items_per_s),
            "latency_p50_ms": _r(percentile(self.latencies_ms, 50)),
            "latency_p99_ms": _r(percentile(self.latencies_ms, 99)),
            "backlog": self.backlog,
            "pending": self.pending,
            "split_retries": self.split_retries,
            "cap_items": self.cap_items,
            "first_pass_early": self.first_pass_early,
        }


class Summary:
    """Accumulates windows between "summary" lines (every ``TRIAGE_LOG_SUMMARY_S``)."""

    MAX_LATENCIES = 100_000  # bound memory on a very busy period; keeps the most recent

    def __init__(self, period_s: float, now_s: float):
        self.period_s = period_s
        self.started_s = now_s
        self._reset(now_s)

    def _reset(self, now_s: float) -> None:
        self.since_s = now_s
        self.windows = 0
        self.passes = 0
        self.items = 0
        self.dead_lettered = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.busy_ms = 0.0
        self.latencies_ms: list[float] = []
        self.reconnects = 0
        self.last_backlog: int | None = None

    def add(self, m: WindowMetrics) -> None:
        self.windows += 1
        self.passes += m.stats.passes
        self.items += m.items
        self.dead_lettered += m.dead_lettered
        self.real_tokens += m.stats.real_tokens
        self.padded_tokens += m.stats.padded_tokens
        self.busy_ms += m.busy_ms
        self.latencies_ms.extend(m.latencies_ms)
        if len(self.latencies_ms) > self.MAX_LATENCIES:
            del self.latencies_ms[: len(self.latencies_ms) - self.MAX_LATENCIES]
        if m.backlog is not None:
            self.last_backlog = m.backlog

    def due(self, now_s: float) -> bool:
        return now_s - self.since_s >= self.period_s

    def take(self, now_s: float) -> dict:
        """The summary record for the period that ends now; starts a new period."""
        wall_s = max(now_s - self.since_s, 1e-9)
        line = {
            "period_s": round(wall_s, 1),
            "uptime_s": round(now_s - self.started_s, 1),
            "windows": self.windows,
            "passes": self.passes,
            "items": self.items,
            "dead_lettered": self.dead_lettered,
            "items_per_s": round(self.items / wall_s, 1),
            "busy_pct": round(min(100.0, 100.0 * self.busy_ms / 1000.0 / wall_s), 1),
            "padding_pct": round(padding_pct(self.real_tokens, self.padded_tokens), 1),
            "latency_p50_ms": _r(percentile(self.latencies_ms, 50)),
            "latency_p99_ms": _r(percentile(self.latencies_ms, 99)),
            "backlog": self.last_backlog,
            "reconnects": self.reconnects,
        }
        self._reset(now_s)
        return line
