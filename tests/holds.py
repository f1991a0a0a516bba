"""Holding a real worker's forward pass from a test: a long pass on a slow device, by construction."""

from __future__ import annotations

import time


def hold(client, *, mark_key=None, mark_value=1, until_key=None, seconds=None, at_most_s: float = 600) -> None:
    """Set ``mark_key`` (to ``mark_value``: the test sees a pass is held), then wait ``seconds``, then until
    ``until_key`` exists (the test releases it; at most ``at_most_s``)."""
    if mark_key is not None:
        client.set(mark_key, mark_value, ex=600)
    if seconds is not None:
        time.sleep(seconds)
    if until_key is not None:
        deadline = time.monotonic() + at_most_s
        while not client.exists(until_key) and time.monotonic() < deadline:
            time.sleep(0.02)
