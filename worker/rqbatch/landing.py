"""Whether a MULTI/EXEC whose reply was lost was applied, so that a write waited out (``RedisWaits.until_written``)
is never applied twice.

Why: an error reply (OOM, READONLY, BUSY, MISCONF, LOADING...) means Redis applied nothing, but a connection that
drops or times out after EXEC was sent may have lost the reply of a transaction Redis applied: tried again, a
failure was saved twice (a retried job queued twice, two failed Results) and a success too (two Results, two
results-stream entries). Each try writes a fresh token to the worker's landing key inside its MULTI; before the next
try, the key says whether the last one landed. The transaction also WATCHes that key: redis-py then reports a lost
reply as a WatchError instead of silently sending the MULTI again (its default retries do, for an unwatched one).
One key per worker, overwritten by each transaction, expiring a day after the last.
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
    """The last try of a transaction, whose reply was lost, was applied: it is not sent again."""


class Landing:
    """The tries of one write (a batch's successes, one job's failure), each a MULTI/EXEC with this worker's token."""

    def __init__(self, worker: BaseWorker):
        self.conn = worker.connection
        self.key = f"{RQ_KEY_PREFIX}:triage:landed:{worker.name}"
        self.sent: bytes | None = None  # the token of a try whose outcome is unknown
        self.then: Callable[[], object] | None = None  # what follows that try once it is applied
        self._only_ours = True  # no other key watched: a WatchError means the connection died

    def settle(self) -> bool:
        """After a try whose outcome is unknown: True if it was applied (its ``then`` has run). Raises what Redis
        raises (still unreachable: the caller waits and settles again)."""
        if self.sent is None:
            return False
        landed = self.conn.get(self.key) == self.sent
        then, self.sent, self.then = self.then, None, None
        if landed and then is not None:
            then()
        return landed

    def watch(self, pipe: Pipeline, *keys: str) -> None:
        """WATCH the landing key (and ``keys``) on ``pipe`` before its MULTI: see the module doc."""
        pipe.watch(self.key, *keys)
        self._only_ours = not keys

    def mark(self, pipe: Pipeline, then: Callable[[], object] | None = None) -> None:
        """This try's token, into ``pipe`` (a MULTI about to be sent): from here its outcome is unknown until
        ``forget`` (it was not applied, or its caller saw it applied) or ``settle``."""
        self.sent, self.then = uuid4().hex.encode(), then
        pipe.set(self.key, self.sent, ex=TOKEN_TTL_S)

    def forget(self) -> None:
        self.sent = self.then = None

    def execute(self, pipe: Pipeline, then: Callable[[], object] | None = None) -> None:
        """EXEC ``pipe`` (watched with ``watch``, then MULTI) with this try's token; ``then()`` once it is applied.

        An error reply raises with nothing applied. A lost reply raises a ConnectionError (a WatchError where
        other keys were watched too: the caller tells) and leaves the token for ``settle``."""
        self.mark(pipe, then)
        try:
            pipe.execute()
        except redis.ResponseError:
            self.forget()
            raise
        except redis.WatchError as e:
            if self._only_ours:  # only this worker writes the key: the connection died after EXEC was sent
                raise redis.ConnectionError(f"the reply of EXEC was lost ({e})") from e
            raise
        self.forget()
        if then is not None:
            then()
