"""A snapshot of a worker group, read from Redis alone (``triage-worker status``).

Like ``rq info``: it works from any machine that reaches Redis, needs no model
and no torch, and never writes. Sources: XINFO GROUPS / CONSUMERS (backlog,
pending per consumer, idle), the heartbeat keys (host, pid, phase, model), and
the tails of the results and dead-letter streams (recent throughput, latency
percentiles, dead letters by reason). Times are measured against Redis's own
clock (TIME), the clock that stamps stream entry ids.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import redis

from worker.engine.types import percentile
from worker.observability.reasons import reason_class
from worker.stream.health import fresh_heartbeats, of_group
from worker.stream.records import stream_id_ms


@dataclass(frozen=True)
class Target:
    """What to look at: the same names the workers use (their TRIAGE_* settings)."""

    stream: str
    group: str
    results_stream: str
    dead_letter_stream: str
    heartbeat_key_prefix: str
    claim_idle_ms: int


def collect(client: redis.Redis, t: Target, *, window_s: float = 60.0, max_results: int = 2000) -> dict[str, Any]:
    """The snapshot as a JSON-ready dict (the ``--json`` output); ``client`` must decode responses."""
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    since_ms = now_ms - int(window_s * 1000)
    queue, consumers = _group(client, t)
    results = _results(client, t.results_stream, now_ms, since_ms, window_s, max_results)
    dead = _dead_letters(client, t.dead_letter_stream, since_ms, max_results)
    beats = {
        name: beat
        for name, beat in fresh_heartbeats(client, t.heartbeat_key_prefix)
        if of_group(beat, t.stream, t.group)
    }
    workers = [
        _worker(name, beats.get(name), consumers.get(name), results["by_worker"].get(name, 0), now_ms, t.claim_idle_ms)
        for name in sorted(set(beats) | set(consumers))
    ]
    dead_workers = [w for w in workers if "dead" in w["flags"]]
    return {
        "time_ms": now_ms,
        "stream": t.stream,
        "group": t.group,
        "claim_idle_ms": t.claim_idle_ms,
        "queue": queue,
        "results": {k: v for k, v in results.items() if k != "by_worker"},
        "dead_letters": dead,
        "workers": workers,
        "summary": {
            "workers": len(workers),
            "alive": sum(w["alive"] for w in workers),
            "dead": len(dead_workers),
            "gone": sum(w["state"] == "gone" for w in workers),  # alive + dead + gone = workers
            "pending_on_dead": sum(w["pending"] for w in dead_workers),
            "reclaimable": sum(w["pending"] for w in dead_workers if "reclaimable" in w["flags"]),
        },
    }


def _group(client: redis.Redis, t: Target) -> tuple[dict[str, Any], dict[str, dict]]:
    """Queue figures of the group, and XINFO CONSUMERS by name (empty when the stream or group is missing)."""
    queue: dict[str, Any] = {"exists": False, "length": 0, "backlog": None, "pending": 0, "last_delivered_id": None}
    try:
        groups = client.xinfo_groups(t.stream)
    except redis.ResponseError as e:
        if "no such key" not in str(e).lower():  # a refusal (NOPERM) or WRONGTYPE is no empty queue: said, not hidden
            raise
        return queue, {}  # no producer and no worker yet
    queue["length"] = int(client.xlen(t.stream))
    for g in groups:
        if g.get("name") == t.group:
            lag = g.get("lag")
            queue.update(
                exists=True,
                backlog=None if lag is None else int(lag),
                pending=int(g.get("pending") or 0),
                last_delivered_id=g.get("last-delivered-id"),
            )
    if not queue["exists"]:
        return queue, {}
    consumers = {c["name"]: c for c in client.xinfo_consumers(t.stream, t.group)}
    return queue, consumers


def _results(client, stream: str, now_ms: int, since_ms: int, window_s: float, max_results: int) -> dict[str, Any]:
    """Throughput and latency of the results written in the window (entry ids carry Redis's write time)."""
    rows = client.xrevrange(stream, max="+", min=str(since_ms), count=max_results + 1)  # one more: capped or not
    capped = len(rows) > max_results
    rows = rows[:max_results]
    newest = rows[0][0] if rows else None
    if newest is None:
        last = client.xrevrange(stream, max="+", min="-", count=1)
        newest = last[0][0] if last else None
    # Capped at max_results: the count is a floor, and the rate is over the span those results cover (from the
    # oldest read to now), not the whole window.
    span_s = window_s
    if capped:
        span_s = max((now_ms - stream_id_ms(rows[-1][0])) / 1000.0, 1e-3)
    latencies = [float(f["latency_ms"]) for _id, f in rows if _is_number(f.get("latency_ms"))]
    by_worker = Counter(f.get("worker", "") for _id, f in rows)
    return {
        "stream": stream,
        "window_s": window_s,
        "count": len(rows),
        "capped": capped,  # count is --max-results: there may be more in the window
        "span_s": round(span_s, 1),  # what per_s is over: the window, or when capped the newest results' span
        "per_s": round(len(rows) / span_s, 2),
        "latency_ms": {
            **{f"p{q}": _r(percentile(latencies, q)) for q in (50, 90, 99)},
            "max": _r(max(latencies, default=None)),
        },
        "newest_age_s": None if newest is None else round(max(0, now_ms - stream_id_ms(newest)) / 1000.0, 1),
        "total": int(client.xlen(stream)),
        "by_worker": dict(by_worker),
    }


def _dead_letters(client, stream: str, since_ms: int, max_rows: int) -> dict[str, Any]:
    rows = client.xrevrange(stream, max="+", min=str(since_ms), count=max_rows)
    by_reason = Counter(reason_class(f.get("reason")) for _id, f in rows)
    return {"stream": stream, "length": int(client.xlen(stream)), "in_window": len(rows), "by_reason": dict(by_reason)}


def _worker(name: str, beat: dict | None, xinfo: dict | None, done: int, now_ms: int, claim_idle_ms: int) -> dict:
    """One row: a consumer of the group and/or a live heartbeat, with what an operator must act on in ``flags``."""
    beat = beat or {}
    pending = int((xinfo or {}).get("pending") or 0)
    idle_ms = (xinfo or {}).get("idle")
    alive = bool(beat)
    flags: list[str] = []
    if not alive and pending:
        flags.append("dead")  # entries held by a process whose heartbeat expired: nobody is working on them
        if idle_ms is not None and idle_ms >= claim_idle_ms:
            flags.append("reclaimable")  # the next XAUTOCLAIM of any live worker takes them
    elif not alive:
        flags.append("gone")  # a name left in the group by a killed worker; harmless (XGROUP DELCONSUMER removes it)
    elif xinfo is None and beat.get("phase") in (None, "starting"):
        # heartbeat set, first read not done: a worker that is starting. Not a ready one that no consumer row shows:
        # Redis 7 adds a consumer to the group only when it first hands it an entry, so an idle worker has none
        flags.append("not_read_yet")
    elif pending and idle_ms is not None and idle_ms >= claim_idle_ms / 2:
        flags.append("slow")  # alive, but its entries approach TRIAGE_CLAIM_IDLE_MS: another worker may reclaim them
    return {
        "consumer": name,
        "alive": alive,
        "state": "alive" if alive else ("dead" if pending else "gone"),
        "flags": flags,
        "host": beat.get("host"),
        "pid": beat.get("pid"),
        "model": beat.get("model"),
        "heartbeat_age_s": _age_s(now_ms, beat.get("beat_at_ms")),
        "uptime_s": _age_s(now_ms, beat.get("started_at_ms")),
        "phase": beat.get("phase"),
        "phase_age_s": _age_s(now_ms, beat.get("phase_since_ms")),
        "pass_age_s": _age_s(now_ms, beat.get("pass_started_at_ms")),
        "pending": pending,
        "idle_s": None if idle_ms is None else round(idle_ms / 1000.0, 1),
        "done_in_window": done,
        "windows": beat.get("windows", beat.get("batches")),  # heartbeats of workers before the rename
        "items": beat.get("items"),
        "dead_lettered": beat.get("dead_lettered"),
    }


def _age_s(now_ms: int, then_ms: Any) -> float | None:
    """Seconds since ``then_ms`` (a worker's clock vs Redis's: skew is clamped at 0)."""
    if not _is_number(then_ms):
        return None
    return round(max(0.0, now_ms - float(then_ms)) / 1000.0, 1)


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
