"""A stand-in for the CUDA graph runner, so the CPU tests can follow what the graph code paths ask of the engine.

Capture is CUDA only. The stand-in never captures (every pass runs eagerly through the real engine) and records
each pass the classifier launches, so a test can check which passes a warm-up ran and in what context.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from types import SimpleNamespace


def stand_in_runner(clf, monkeypatch, *, first_sight=nullcontext, record: Callable = lambda chunk: chunk) -> list:
    """Give ``clf`` the stand-in runner; returns the list ``record(chunk)`` is appended to at every launched pass."""
    launched: list = []
    launch = clf.launch_pass
    monkeypatch.setattr(clf, "launch_pass", lambda c, *a, **kw: launched.append(record(c)) or launch(c, *a, **kw))
    runner = SimpleNamespace(
        layout_for=lambda layout: layout,
        run=lambda *a: None,  # None: the caller runs the pass eagerly
        capturing_at_first_sight=first_sight,
        captures=0,
        replays=0,
    )
    monkeypatch.setattr(clf, "graph_runner", lambda: runner)
    return launched
