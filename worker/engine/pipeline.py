"""The order in which a run of passes is launched and read back: one pass in flight ahead (CUDA's lookahead).

Kept apart from the classifier so the order, not the model, is what its tests check: a pass is
queued before the one ahead of it is read back, an earlier launch of the first pass is adopted, the
last pass is announced before its read-back (the worker queues the next window's first pass there),
and a launch that fails comes after the pass before it was handed out, so the failure belongs to
the pass that failed. Pure: no torch (``launch`` and ``complete`` are passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

P = TypeVar("P")  # a planned pass
R = TypeVar("R")  # what ``complete`` hands back


def run_ahead(
    passes: Sequence[P],
    launch: Callable[[P], Any],
    complete: Callable[[P, Any], R],
    *,
    ahead: bool,
    adopt: Callable[[P], Any] | None = None,
    before_last: Callable[[Any], None] | None = None,
) -> Iterator[R]:
    """``complete(pass, launched)`` of every pass, in order.

    ``ahead``: pass k+1 is launched before pass k is completed, so the device never waits for the host's
    per-pass work; otherwise each pass is completed right after its launch. ``adopt(passes[0])``: a launch
    of the first pass made earlier, or None to launch it here. ``before_last(launched)``: called with the
    last pass launched and not completed yet (``ahead`` only).
    """
    pending = None
    for j, p in enumerate(passes):
        launched = adopt(p) if adopt is not None and j == 0 else None
        try:
            if launched is None:
                launched = launch(p)
        except Exception:
            if pending is not None:  # the pass before ran: hand it out first, so the failure is this pass's
                yield complete(*pending)
            raise
        if pending is not None:
            yield complete(*pending)
        pending = (p, launched)
        if not ahead:
            yield complete(*pending)
            pending = None
    if pending is not None:
        if before_last is not None:
            before_last(pending[1])
        yield complete(*pending)
