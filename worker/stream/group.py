"""The one place that reacts to a lost consumer group (NOGROUP anywhere: a read, the write of a
window, the refresh of in-flight entries).

A group disappears when Redis restarts without its data or somebody runs ``XGROUP DESTROY``.
Everything this process read from the lost group is void: its pending list is gone, so those
entries can no longer be acknowledged (and, after a restart without data, no longer exist).
The guard recreates the group at the recovery point (``StreamSource.ensure_group``) and moves
to a new *epoch*; windows read in an older epoch are dropped by the loop, not classified or
written. Entries that still exist after the recovery point are delivered again; what Redis
itself lost is lost (docs/reliability.md, "Recovery point").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from worker.stream.scripts import error_code
from worker.stream.sink import GroupLost
from worker.stream.source import StreamSource


def is_nogroup(e: BaseException) -> bool:
    """NOGROUP from any command: the group, or the whole stream, is gone."""
    if isinstance(e, GroupLost):
        return True
    return isinstance(e, redis.ResponseError) and error_code(e) == "NOGROUP"


class GroupGuard:
    def __init__(self, source: StreamSource, log):
        self.source = source
        self.log = log
        self.epoch = 0  # incremented each time this process recreated (or found recreated) a lost group
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def on_recovered(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def in_epoch(self, epoch: int, fn: Callable[[], None]) -> bool:
        """Run ``fn`` only if no recovery happened since ``epoch`` (False: skipped), with no recovery in between:
        a read cursor kept after a read must not overwrite the reset a recovery just made to it."""
        with self._lock:
            if epoch != self.epoch:
                return False
            fn()
            return True

    def recover(self, seen_epoch: int, *, op: str, error: BaseException) -> None:
        """React to NOGROUP met by an operation that started in ``seen_epoch``.

        Once per loss: an operation that started before a recovery it did not see is already
        covered. Raises what ``ensure_group`` raises (Redis down): the caller retries as for
        any Redis error and will meet NOGROUP again."""
        self._new_epoch(seen_epoch, op, f"{type(error).__name__}: {error}", create=True)

    def found_recreated(self, seen_epoch: int, *, op: str, ids: list[str]) -> None:
        """The group was recreated underneath without this process meeting NOGROUP (another worker's recovery, an
        operator's DESTROY + CREATE, Redis back from an older snapshot): ``ids``, held by this process from
        ``seen_epoch``, were just delivered again as new. As ``recover``, without creating the group: a new epoch,
        held windows dropped, this consumer's pending entries read again (those ids among them). Before, they
        were skipped as in hand and then pending in no window until XAUTOCLAIM took them, TRIAGE_CLAIM_IDLE_MS
        later."""
        self._new_epoch(seen_epoch, op, f"{len(ids)} entries in hand delivered again as new (first {ids[0]})")

    def _new_epoch(self, seen_epoch: int, op: str, error: str, *, create: bool = False) -> None:
        """Once per loss (an operation from an older epoch is covered already): the group created at the recovery
        point if asked, the epoch moved on, the listeners told."""
        with self._lock:
            if seen_epoch != self.epoch:
                return
            # ensure_group: the id it created the group at, or None when another worker had created it
            start = (
                (self.source.ensure_group() or "(recreated by another worker)") if create else "(recreated underneath)"
            )
            self.epoch += 1
            self.log.warning(
                "group_recreated",
                op=op,
                error=error,
                epoch=self.epoch,
                start_id=start,
                note="windows read from the lost group are dropped; entries after the recovery point are "
                "delivered again",
            )
            for fn in self._listeners:
                fn()
