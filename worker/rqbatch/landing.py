"""Whether a MULTI/EXEC whose reply was lost was applied, so that a write waited out (``RedisWaits.until_written``)
is never applied twice.

Why: an error reply (OOM, READONLY, BUSY, MISCONF, LOADING...) means Redis applied nothing, but a connection that
drops or times out after EXEC was sent may have lost the reply of a transaction Redis applied: tried again, a
failure was saved twice (a retried job queued twice, two failed Results) and a success too (two Results, two
results-stream entries). Each try writes a fresh token to the worker's landing key inside its MULTI and WATCHes
that key first; before sending anything, a try reads the key (after its WATCH, on its own connection) for the token
of any earlier try whose outcome is unknown. An earlier try whose EXEC is still on its way (a slow network, a
proxy) is not lost track of: arriving after that read it aborts this try (the key changed), and arriving after
this try it aborts itself (its own WATCH). So at most one try of a write is ever applied. The WATCH also makes
redis-py report a lost reply as a WatchError instead of silently sending the MULTI again (its default retries do,
for an unwatched one). One key per worker, overwritten by each transaction, expiring a day after the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from uuid import uuid4

import redis
from rq.defaults import RQ_KEY_PREFIX

if TYPE_CHECKING:
    from redis.client import Pipeline
    from rq.worker import BaseWorker

TOKEN_TTL_S = 24 * 3600


class Landed(Exception):
    """An earlier try of a transaction, whose reply was lost, was applied: it is not sent again."""


class Landing:
    """The tries of one write (a batch's successes, one job's failure), each a MULTI/EXEC with this worker's token."""

    def __init__(self, worker: BaseWorker):
        self.conn = worker.connection
        self.key = f"{RQ_KEY_PREFIX}:triage:landed:{worker.name}"
        # every try not known to be applied, oldest first, with what follows it once it is: one refused (an error
        # reply) or aborted (a WATCH) never lands and stays harmlessly; the key can only ever hold an applied one's
        self.unknown: list[tuple[bytes, Callable[[], object] | None]] = []
        self._only_ours = True  # no other key watched: a WatchError means the connection died

    def settle(self, pipe: Pipeline | None = None) -> bool:
        """True if an earlier try was applied (its ``then`` has run, and no other try of this write can be any more).
        On ``pipe``, after its WATCH of the key (``watch``) and its other reads: an earlier try landing later aborts
        ``pipe``'s EXEC, and one landing before a read is seen here. Raises what Redis raises (still unreachable: the
        caller waits and settles again)."""
        if not self.unknown:
            return False
        try:
            token = pipe.immediate_execute_command("GET", self.key) if pipe is not None else self.conn.get(self.key)
        except redis.WatchError as e:  # redis-py's word for a connection lost while watching: not a conflict
            raise redis.ConnectionError(f"the connection was lost ({e})") from e
        for sent, then in self.unknown:
            if sent == token:
                self.unknown = []
                if then is not None:
                    then()
                return True
        return False

    def watch(self, pipe: Pipeline, *keys: str) -> None:
        """WATCH the landing key (and ``keys``) on ``pipe`` before its MULTI; then the caller's reads, then
        ``settle(pipe)`` (True: an earlier try was applied, send nothing)."""
        pipe.watch(self.key, *keys)
        self._only_ours = not keys

    def watch_late(self, pipe: Pipeline) -> None:
        """``watch`` and ``settle`` for a transaction someone else (RQ) WATCHed and opened already: the WATCH and the
        read go on its connection at once, before its queued MULTI is sent (the caller tells what landed by the
        ``then`` that ran)."""
        pipe.immediate_execute_command("WATCH", self.key)
        self.settle(pipe)

    def mark(self, pipe: Pipeline, then: Callable[[], object] | None = None) -> None:
        """This try's token, into ``pipe`` (a MULTI about to be sent): from here its outcome is unknown until
        ``applied`` or ``settle``."""
        token = uuid4().hex.encode()
        self.unknown.append((token, then))
        pipe.set(self.key, token, ex=TOKEN_TTL_S)

    def applied(self) -> None:
        """The try just sent was applied (its caller saw EXEC's reply): no earlier one can be any more."""
        self.unknown = []

    def execute(self, pipe: Pipeline, then: Callable[[], object] | None = None) -> None:
        """EXEC ``pipe`` (watched with ``watch``, then MULTI) with this try's token; ``then()`` once it is applied.

        An error reply raises with nothing applied. A lost reply raises a ConnectionError (a WatchError where
        other keys were watched too: the caller tells) and leaves the token for ``settle``."""
        self.mark(pipe, then)
        try:
            pipe.execute()
        except redis.WatchError as e:
            if self._only_ours:  # only this worker writes the key: the connection died after EXEC was sent
                raise redis.ConnectionError(f"the reply of EXEC was lost ({e})") from e
            raise
        self.applied()
        if then is not None:
            then()
