"""Shutdown.request: which reason and exit code a stop ends with when several come together."""

from __future__ import annotations

from worker.logs import get_logger
from worker.stream.shutdown import Shutdown


def test_a_stop_that_exits_non_zero_wins_over_an_earlier_warm_one():
    """A SIGTERM sent to a frozen worker is delivered on SIGCONT, just before its keeper finds its name lost."""
    s = Shutdown(get_logger("t"))
    s.request("signal SIGTERM")
    s.request("consumer name lost", exit_code=2)
    assert (s.reason, s.exit_code, s.stop.is_set()) == ("consumer name lost", 2, True)


def test_otherwise_the_first_reason_stays():
    s = Shutdown(get_logger("t"))
    s.request("consumer name lost", exit_code=2)
    s.request("signal SIGTERM")
    s.request("drained")
    assert (s.reason, s.exit_code) == ("consumer name lost", 2)
    warm = Shutdown(get_logger("t"))
    warm.request("drained")
    warm.request("signal SIGTERM")
    assert (warm.reason, warm.exit_code) == ("drained", 0)
