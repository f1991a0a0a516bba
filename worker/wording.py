"""Counts in sentences people read ("1 worker", "2 workers"): the CLI's and the demo's summaries."""

from __future__ import annotations


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``plural``, else ``noun`` + "s") unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
