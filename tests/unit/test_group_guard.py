"""GroupGuard.in_epoch: a reader's step (keeping its read cursor) and a recovery (which resets that cursor) never
interleave, so the reset after a lost group always stands."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from worker.stream.group import GroupGuard

QUIET = SimpleNamespace(warning=lambda *a, **k: None)


class _Source:
    """Only what ``recover`` calls: the group is recreated at once."""

    def ensure_group(self) -> str:
        return "0-0"


def test_a_recovery_waits_for_a_step_in_its_epoch_and_resets_after_it():
    guard = GroupGuard(_Source(), QUIET)
    order: list[str] = []
    guard.on_recovered(lambda: order.append("reset"))
    inside, release = threading.Event(), threading.Event()

    def keep_cursor():
        inside.set()
        release.wait(5)
        order.append("kept")

    step = threading.Thread(target=guard.in_epoch, args=(0, keep_cursor))
    step.start()
    assert inside.wait(5)
    recovery = threading.Thread(target=guard.recover, args=(0,), kwargs={"op": "write", "error": Exception("NOGROUP")})
    recovery.start()
    recovery.join(0.2)
    assert order == [] and guard.epoch == 0  # the recovery cannot run while the step is inside
    release.set()
    step.join(5)
    recovery.join(5)
    assert order == ["kept", "reset"] and guard.epoch == 1


def test_a_step_of_an_older_epoch_is_skipped():
    guard = GroupGuard(_Source(), QUIET)
    guard.recover(0, op="read", error=Exception("NOGROUP"))
    ran: list[int] = []
    assert guard.in_epoch(0, lambda: ran.append(0)) is False
    assert guard.in_epoch(1, lambda: ran.append(1)) is True
    assert ran == [1]
