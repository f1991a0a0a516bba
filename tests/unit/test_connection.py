"""worker.stream.connection: the reconnect backoff schedule. Pure."""

from __future__ import annotations

from worker.stream.connection import backoff_s


def test_backoff_schedule_doubles_then_caps():
    assert [backoff_s(n, base_s=0.1, max_s=1.0) for n in range(0, 7)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff_s(10_000, max_s=10.0) == 10.0
    assert backoff_s(3, base_s=1.0, max_s=10.0, jitter=0.5) == 2.0
