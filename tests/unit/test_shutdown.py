"""Shutdown.request / outcome: which exit code and reason a stop ends with when several come together."""

from __future__ import annotations

from worker.logs import get_logger
from worker.stream.shutdown import Shutdown


def test_a_stop_that_exits_non_zero_wins_over_a_warm_one_before_or_after_it():
    """A SIGTERM sent to a frozen worker is delivered on SIGCONT, as its keeper finds its name lost."""
    for first, then in (
        (("signal SIGTERM", 0), ("consumer name lost", 2)),
        (("consumer name lost", 2), ("drained", 0)),
    ):
        s = Shutdown(get_logger("t"))
        s.request(*first)
        s.request(*then)
        assert s.stop.is_set()
        assert s.outcome(0, "stopped") == (2, "consumer name lost")


def test_otherwise_the_first_warm_reason_stays_and_a_failure_of_the_loop_is_kept():
    s = Shutdown(get_logger("t"))
    s.request("drained")
    s.request("signal SIGTERM")
    assert s.reason == "drained" and s.outcome(0, "drained") == (0, "drained")
    s.request("consumer name lost", exit_code=2)
    assert s.outcome(1, "writer crashed") == (1, "writer crashed")  # the loop's own failure says more
