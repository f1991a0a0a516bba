"""Redis client construction and the reconnect policy (capped exponential backoff).

redis-py's own silent retries are switched off: a write replayed blindly
after a lost reply could write a pass twice. The worker retries itself and
knows what it is retrying (see ``loop.py``: a write is retried only for the
entries that are still pending).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from worker.stream.scripts import error_message

# Errors that mean "Redis is (temporarily) unreachable", not "the request is wrong". During a failover or a
# restart Redis answers LOADING, READONLY, MASTERDOWN or TRYAGAIN before it is ready: redis-py turns them into these
# classes and drops the code from the message, so they are told by class (and by code, from older clients).
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls
    for cls in (
        redis.ConnectionError,
        redis.TimeoutError,
        redis.exceptions.BusyLoadingError,
        getattr(redis.exceptions, "ReadOnlyError", None),
        getattr(redis.exceptions, "MasterDownError", None),
        getattr(redis.exceptions, "TryAgainError", None),
        ConnectionResetError,
        BrokenPipeError,
    )
    if cls is not None
)
TRANSIENT_CODES = ("LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN")
# States of a reachable Redis that pass without a change to the worker's settings: a script running (BUSY), a failed
# background save under stop-writes-on-bgsave-error (MISCONF), memory full under noeviction (OOM). At start-up the
# worker waits them out as it waits for Redis; while running, a write is retried anyway.
PASSING_CODES = ("BUSY ", "MISCONF ", "OOM ")  # with the space: BUSYGROUP and BUSYKEY are not states


def is_transient(exc: BaseException) -> bool:
    """``TRANSIENT_ERRORS``, or a reply with one of ``TRANSIENT_CODES``: also from a script on Redis 6.2, which wraps
    it (a read script on a replica: ``scripts.error_message``), where redis-py gives no class of its own."""
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    return isinstance(exc, redis.ResponseError) and error_message(exc).startswith(TRANSIENT_CODES)


def is_passing(exc: BaseException) -> bool:
    """Redis answers, in a state that passes by itself (``PASSING_CODES``), or is unreachable for now."""
    if is_transient(exc) or isinstance(exc, getattr(redis.exceptions, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, redis.ResponseError) and error_message(exc).startswith(PASSING_CODES)


# What each passing state is, and what ends it: the start-up wait and --drain's give-up line say it (an OOM told the
# operator to "check TRIAGE_REDIS_URL and that Redis is running").
UNREACHABLE = ("unreachable", "check TRIAGE_REDIS_URL and that Redis is running")
_STATES: tuple[tuple[tuple[type[BaseException], ...], str, tuple[str, str]], ...] = (
    (
        (redis.exceptions.BusyLoadingError,),
        "LOADING",
        ("loading", "Redis is loading its data set; it answers when done"),
    ),
    (
        tuple(c for c in (getattr(redis.exceptions, "ReadOnlyError", None),) if c),
        "READONLY",
        ("replica", "TRIAGE_REDIS_URL points at a read-only replica: point it at the primary, or wait for a failover"),
    ),
    (
        tuple(c for c in (getattr(redis.exceptions, "MasterDownError", None),) if c),
        "MASTERDOWN",
        ("replica", "the replica at TRIAGE_REDIS_URL has lost its primary: point it at the primary"),
    ),
    (
        tuple(c for c in (getattr(redis.exceptions, "TryAgainError", None),) if c),
        "TRYAGAIN",
        ("resharding", "Redis is moving the keys' slot; it answers when done"),
    ),
    (
        (),
        "BUSY ",
        ("busy", "a script or function is running in Redis: it ends by itself, or SCRIPT KILL / FUNCTION KILL"),
    ),
    (
        (),
        "MISCONF ",
        (
            "misconf",
            "Redis refuses writes after a failed save (stop-writes-on-bgsave-error): fix its disk or that setting",
        ),
    ),
    (
        tuple(c for c in (getattr(redis.exceptions, "OutOfMemoryError", None),) if c),
        "OOM ",
        ("out_of_memory", "Redis is at maxmemory under noeviction: free memory, raise maxmemory or trim its streams"),
    ),
)


def passing_state(exc: BaseException) -> tuple[str, str]:
    """(state, what ends it) for an error ``is_passing`` accepts: ``unreachable`` unless Redis answered with a state."""
    for classes, code, state in _STATES:
        if (classes and isinstance(exc, classes)) or (
            isinstance(exc, redis.ResponseError) and error_message(exc).startswith(code)
        ):
            return state
    return UNREACHABLE


# How long a reply may take before the client gives up (a Redis that stopped answering is found this late). It must
# be longer than the longest BLOCK the worker uses: the reader's 0.5 s idle block, and the read that fills a window,
# which blocks up to TRIAGE_MAX_WAIT_MS: ``socket_timeout_for`` grows the timeout with that setting.
SOCKET_TIMEOUT_S = 15.0
BLOCK_MARGIN_S = 5.0  # a BLOCK's reply may come this much after the block ends (network, a busy Redis)


def socket_timeout_for(max_wait_ms: int) -> float:
    """The stream worker's socket timeout: ``SOCKET_TIMEOUT_S``, or TRIAGE_MAX_WAIT_MS + ``BLOCK_MARGIN_S`` when that
    is longer (a fill read blocking past the timeout read as "Redis unavailable" on every window)."""
    return max(SOCKET_TIMEOUT_S, max_wait_ms / 1000.0 + BLOCK_MARGIN_S)


def connect(url: str, *, socket_timeout_s: float = SOCKET_TIMEOUT_S, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A client that hands back raw bytes (the worker decodes and validates itself)."""
    # TCP keepalive finds a peer that vanished (a failed-over host) on an idle connection; redis-py's Unix socket
    # connection takes no such option (the worker did not start on a unix:// URL that `check` passed)
    tcp_only = {} if url.strip().lower().startswith("unix:") else {"socket_keepalive": True}
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=socket_timeout_s,  # > the longest BLOCK the worker uses (socket_timeout_for)
        socket_connect_timeout=connect_timeout_s,
        **tcp_only,
        health_check_interval=30,
        retry=Retry(NoBackoff(), 0),
        client_name="triage-worker",
    )


def reply_parser() -> str:
    """Which reply parser redis-py uses: ``hiredis`` (C, a dependency) or ``python`` (its fallback).

    A window of 4,096 tickets is one read script's reply of ~25,000 elements (read_scripts.py): 8-14 ms of the
    reader's CPU with hiredis, several times that in pure Python (~100 ms for the XREADGROUP reply it replaced), all
    of it holding the GIL that the thread launching the passes needs."""
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "python"


def backoff_s(attempt: int, *, base_s: float = 0.1, max_s: float = 10.0, jitter: float = 0.0) -> float:
    """Delay before retry number ``attempt`` (1-based): base * 2**(attempt-1), capped at ``max_s``.

    ``jitter`` in [0, 1) shaves up to that fraction off, so many workers that lost
    Redis together do not reconnect in lockstep. Pure, so the schedule is testable.
    """
    if attempt < 1:
        return 0.0
    delay = min(max_s, base_s * (2 ** min(attempt - 1, 62)))
    return delay * (1.0 - min(max(jitter, 0.0), 0.999))


class Backoff:
    """Counts consecutive failures of one operation and sleeps the schedule; ``reset`` on success."""

    def __init__(self, max_s: float, *, base_s: float = 0.1, sleep: Callable[[float], object] | None = None):
        self.max_s = max_s
        self.base_s = base_s
        self.attempt = 0
        self._sleep = sleep

    def failed(self, stop: threading.Event | None = None) -> float:
        """Record a failure, sleep the next delay (waking early if ``stop`` is set); returns the delay."""
        self.attempt += 1
        delay = backoff_s(self.attempt, base_s=self.base_s, max_s=self.max_s, jitter=random.random() * 0.2)
        if self._sleep is not None:
            self._sleep(delay)
        elif stop is not None:
            stop.wait(delay)
        else:
            threading.Event().wait(delay)
        return delay

    def reset(self) -> int:
        """Back to the first delay; returns how many failures there were."""
        n, self.attempt = self.attempt, 0
        return n
