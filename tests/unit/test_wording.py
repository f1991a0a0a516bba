"""Counts in the summaries people read: "1 worker", never "1 workers"."""

from __future__ import annotations

from worker.wording import count_of


def test_one_is_singular_every_other_count_plural():
    assert [count_of(n, "window") for n in (0, 1, 2)] == ["0 windows", "1 window", "2 windows"]
    assert count_of(1, "forward pass", "forward passes") == "1 forward pass"
    assert count_of(3, "forward pass", "forward passes") == "3 forward passes"
