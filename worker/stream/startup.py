"""Start-up of the stream worker, before the run loop (``loop.py``) takes over: signals, Redis and
the consumer group, the heartbeat, then the model; and at exit, ``release`` of the name it took.

Redis first, the model second: a wrong URL or a Redis that is down shows in the first second,
not after the model has loaded (seconds to minutes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis

from worker.key_checks import refused_commands
from worker.logs import get_logger, mask_url
from worker.observability import prometheus  # no-ops unless TRIAGE_METRICS_PORT is set
from worker.stream.connection import Backoff, connect, is_passing, passing_state, socket_timeout_for
from worker.stream.health import Heartbeat, Keeper, NameInUse, Status
from worker.stream.shutdown import Shutdown
from worker.stream.source import ReadLimits, StreamSource

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_REDIS = 0, 1, 2, 3
PERMISSION_FIX = (
    "give the worker's ACL user the commands and keys named (docs/reliability.md, the ACL line; widen its ~triage:* "
    "if the streams are renamed), then restart"
)


@dataclass
class Started:
    """What start-up made for the run loop."""

    client: redis.Redis
    source: StreamSource
    shutdown: Shutdown
    log: Any
    status: Status
    heartbeat: Heartbeat
    keeper: Keeper
    clf: Any  # the loaded, warmed-up classifier


def start(settings, *, drain: bool) -> Started | int:
    """Everything the loop needs, or the exit code to stop with (a signal while waiting for Redis, a key
    of the wrong type, Redis unreachable with ``drain``)."""
    log = get_logger("triage.worker").bind(consumer=settings.consumer)
    shutdown = Shutdown(log)
    shutdown.install()
    client = connect(settings.redis_url, socket_timeout_s=socket_timeout_for(settings.max_wait_ms))
    limits = ReadLimits.for_worker(settings)  # what one read may bring (TRIAGE_READ_MAX_BYTES)
    source = StreamSource(client, settings.input_stream, settings.group, settings.consumer, limits)
    ready = _setup(source, settings, shutdown, log, give_up_s=settings.drain_redis_timeout_s if drain else None)
    if ready != "ok":
        if ready == "stopped":
            log.info("worker_stopped", reason=shutdown.reason or "stopped", windows=0, items=0, dead_lettered=0)
            return EXIT_OK
        return EXIT_REDIS if ready == "unreachable" else EXIT_CONFIG

    status = Status(on_phase=prometheus.current().set_phase, stop=shutdown.stop)
    heartbeat = Heartbeat(
        client,
        settings.heartbeat_key_prefix,
        settings.consumer,
        settings.heartbeat_ttl_s,
        {"stream": settings.input_stream, "group": settings.group, "model": settings.model},
    )
    if not _claim_name(heartbeat, shutdown, log):
        return EXIT_CONFIG
    if shutdown.stop.is_set():  # a signal while a dead holder's key was waited out
        log.info("worker_stopped", reason=shutdown.reason or "stopped", windows=0, items=0, dead_lettered=0)
        return EXIT_OK
    keeper = Keeper(
        heartbeat,
        status,
        refresh=None,
        refresh_interval_s=settings.claim_idle_ms / 3000.0,
        log=log,
        on_lost=lambda holder: _name_lost(holder, shutdown, log),
    )
    keeper.start()  # phase "starting" while the model loads
    shutdown.before_cold_exit = partial(_release_at_once, settings.redis_url, heartbeat, keeper)
    try:
        clf = _load_model(settings, log)
    except BaseException:
        keeper.stop()
        _quietly(heartbeat.clear)
        raise
    heartbeat.info["model"] = clf.model_name
    if shutdown.stop.is_set():  # a signal (or the name lost) while the model loaded: nothing read, nothing to finish
        keeper.stop()
        code, why = shutdown.outcome(EXIT_OK, shutdown.reason or "stopped")
        _quietly(heartbeat.clear)  # not a key another process took over (compare-and-delete)
        log.info("worker_stopped", reason=why, windows=0, items=0, dead_lettered=0)
        return code
    return Started(client, source, shutdown, log, status, heartbeat, keeper, clf)


def _release_at_once(url: str, heartbeat: Heartbeat, keeper: Keeper, within_s: float = 1.0) -> None:
    """A cold exit's heartbeat release (compare-and-delete), at most ``within_s`` of it: the keeper stopped first (a
    beat after the release would write the key again), then the release on a client of its own, from a thread of its
    own (the signal may have interrupted the main thread inside the worker's client, its pool's lock held; a name
    lookup or a slow Redis is not bounded by socket timeouts)."""
    deadline = time.monotonic() + within_s
    keeper.stop(timeout_s=within_s / 2)

    failed: list[Exception] = []

    def release() -> None:
        client = connect(url, socket_timeout_s=0.5, connect_timeout_s=0.5)
        try:
            heartbeat.clear(client)
        except Exception as e:  # noqa: BLE001 - said by the caller's log line, not a thread's traceback
            failed.append(e)
        finally:
            client.close()

    t = threading.Thread(target=release, name="cold-exit-release", daemon=True)
    t.start()
    t.join(max(deadline - time.monotonic(), 0.1))
    if t.is_alive():
        raise TimeoutError(f"Redis did not take the heartbeat's release within {within_s:g} s")
    if failed:
        raise failed[0]


def _claim_name(heartbeat: Heartbeat, shutdown: Shutdown, log) -> bool:
    """The consumer name for this process alone (``Heartbeat.claim``); False: another live process has it."""

    def waiting(holder: dict, at_most_s: float) -> None:
        log.warning(
            "consumer_name_held",
            holder_host=holder.get("host"),
            holder_pid=holder.get("pid"),
            holder_beat_at_ms=holder.get("beat_at_ms"),
            note=f"waiting up to {at_most_s:.1f} s: a live holder refreshes its heartbeat, a dead one's expires",
        )

    try:
        claim = heartbeat.claim(shutdown.stop, on_wait=waiting)
    except NameInUse as e:
        log.error(
            "consumer_in_use",
            holder_host=e.holder.get("host"),
            holder_pid=e.holder.get("pid"),
            holder_phase=e.holder.get("phase"),
            fix="another live worker uses this TRIAGE_CONSUMER: give each process its own name (the default "
            "<hostname>-<pid> is unique) or stop the other one",
        )
        return False
    except Exception as e:  # noqa: BLE001 - a guard, not a dependency: Redis trouble shows on the first read
        log.warning("consumer_name_unchecked", error=f"{type(e).__name__}: {e}")
        return True
    if claim.took and shutdown.stop.is_set():  # a signal right after the take: the caller exits, the name is free
        _quietly(heartbeat.clear)
    elif claim.took and claim.previous is not None:
        log.info(
            "consumer_name_taken_over",
            previous_host=claim.previous.get("host"),
            previous_pid=claim.previous.get("pid"),
        )
    return True


EXIT_STEP_TIMEOUT_S = 2.0  # each of the exit's two Redis calls: a Redis that stopped answering does not hold the exit


def release(heartbeat: Heartbeat, source: StreamSource, url: str, *, reader_done: bool, log) -> None:
    """At exit: the group's consumer, then the heartbeat key, each on its own (a stopped worker must not look alive).

    No trail of dead names in XINFO (each process has its own), but never while the reader may still read (an entry
    taken after the count would leave the pending list with the consumer, unacked), nor once another process holds
    the name (its entries would go with it). Before the key is cleared: while it is ours, a newcomer waits. On a
    client of its own with a short timeout: on the worker's (15 s or more) a Redis that stopped answering held a
    warm stop 30 s past the read in progress."""
    client = connect(url, socket_timeout_s=EXIT_STEP_TIMEOUT_S, connect_timeout_s=EXIT_STEP_TIMEOUT_S)

    def leave_group() -> None:
        if reader_done:
            heartbeat.leave_group(source.stream, source.group, source.consumer, client)

    try:
        for step in (leave_group, lambda: heartbeat.clear(client)):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                log.warning("cleanup_failed", error=str(e))
    finally:
        client.close()


def _name_lost(holder: dict, shutdown: Shutdown, log) -> None:
    """Keeper thread: this process was frozen past its heartbeat's TTL and another took the name over. Two
    processes under one name re-read each other's pending entries, so this one stops (exit 2) as a signal's warm
    stop does: it stops reading and finishes what it holds (a result the other wrote first is not written
    twice: the settle script writes only for entries still pending)."""
    log.error(
        "consumer_name_lost",
        holder_host=holder.get("host"),
        holder_pid=holder.get("pid"),
        holder_phase=holder.get("phase"),
        action="stopping (exit 2): another process holds this TRIAGE_CONSUMER's heartbeat (it took the name "
        "while this one's key was gone: frozen past its TTL, a Redis outage or restart); finishing what it holds, "
        "reading no more",
    )
    shutdown.request("consumer name lost", exit_code=EXIT_CONFIG)


def _load_model(settings, log):
    from worker.model_start import start_model

    clf, facts = start_model(settings, log)
    log.info(
        "model_loaded",
        model=clf.model_name,
        device=str(clf.device),
        dtype=clf.dtype_name,
        labels=list(clf.labels),
        prefix_tokens=clf.prefix_length,
        **facts,
    )
    prometheus.current().set_model(
        model=clf.model_name, device=str(clf.device), dtype=clf.dtype_name, consumer=settings.consumer
    )
    return clf


def _setup(source: StreamSource, settings, shutdown: Shutdown, log, *, give_up_s: float | None) -> str:
    """Create the group (waiting for Redis if needed) and refuse keys of the wrong type.

    "ok", "stopped" (a signal while waiting), "config" (wrong key type, no permission) or
    "unreachable" (``give_up_s`` passed without an answer: --drain must not hang forever)."""
    backoff = Backoff(settings.reconnect_max_s)
    t0 = time.monotonic()
    while not shutdown.stop.is_set():
        try:
            created = source.ensure_group()
            for name in (settings.input_stream, settings.results_stream, settings.dead_letter_stream):
                kind = source.key_type(name)
                if kind not in ("none", "stream"):
                    log.error(
                        "wrong_key_type",
                        key=name,
                        type=kind,
                        expected="stream",
                        fix="rename the key or point TRIAGE_*_STREAM elsewhere",
                    )
                    return "config"
            refused = refused_commands(source.client, settings)  # every command the worker sends (key_checks)
            if refused:
                log.error("permission_denied", error="; ".join(refused), action=PERMISSION_FIX)
                return "config"
            if backoff.reset():
                prometheus.current().reconnected()
                log.info("redis_reconnected", op="setup")
            if created is not None:
                log.info("group_created", stream=settings.input_stream, group=settings.group, start_id=created)
            return "ok"
        except Exception as e:  # noqa: BLE001
            if not is_passing(e):  # NOPERM, WRONGTYPE: the settings' to fix (a wrong password waits: a ConnectionError)
                refused = _refusals(source, settings)  # the ACL's refusals, all of them, explain it better
                if refused:
                    log.error("permission_denied", error="; ".join(refused), action=PERMISSION_FIX)
                else:
                    log.error("setup_failed", error=f"{type(e).__name__}: {e}")
                return "config"
            waited_s = time.monotonic() - t0
            state, fix = passing_state(e)
            if backoff.attempt == 0:
                give_up = (
                    f"; --drain gives up after {give_up_s:g} s (TRIAGE_DRAIN_REDIS_TIMEOUT_S)" if give_up_s else ""
                )
                log.warning(
                    "waiting_for_redis",
                    redis_url=mask_url(settings.redis_url),
                    error=f"{type(e).__name__}: {e}",
                    state=state,
                    fix=fix,
                    note="the model is loaded once Redis answers" + give_up,
                )
            if give_up_s is not None and waited_s >= give_up_s:
                log.error(
                    "redis_unreachable",
                    redis_url=mask_url(settings.redis_url),
                    waited_s=round(waited_s, 1),
                    error=f"{type(e).__name__}: {e}",
                    state=state,
                    action=f"giving up (exit 3): {fix}",
                )
                return "unreachable"
            delay = backoff.failed(shutdown.stop)
            log.warning(
                "redis_unavailable",
                op="setup",
                error=f"{type(e).__name__}: {e}",
                attempt=backoff.attempt,
                retried_after_s=round(delay, 2),
            )
    return "stopped"


def _refusals(source: StreamSource, settings) -> list[str]:
    """``refused_commands`` after a set-up step failed ([] when it cannot be asked): that step's own error says too
    little (a MULTI refused reads "EXEC without MULTI", an XGROUP CREATE refused names no key) and only the first."""
    try:
        return refused_commands(source.client, settings)
    except Exception:  # noqa: BLE001 - the setup's own error is reported instead
        return []


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
