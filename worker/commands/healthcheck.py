"""Exit 0 if a worker's heartbeat key is fresh (any worker, --consumer NAME, or --host HOST), else 1; with
--ready, only a worker past start-up (its model loaded) counts. Without --consumer only workers of this
TRIAGE_INPUT_STREAM and TRIAGE_GROUP count (as in ``status``): two deployments sharing the heartbeat prefix kept
each other healthy; a named consumer is that worker, whatever it reads.

Meant for container health checks: it only needs Redis (no model, no torch) and
prints the live heartbeats as JSON lines on stdout. Its Redis user needs only SCAN and GET on the heartbeat keys
(GET alone with --consumer): the ops ACL line of docs/reliability.md ("Security") covers it.
"""

from __future__ import annotations

import argparse
import json
import sys

NAME = "healthcheck"
HELP = "exit 0 if a worker heartbeat (TRIAGE_HEARTBEAT_KEY_PREFIX + consumer) is fresh, else 1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--consumer", help="check this consumer only (default: any worker)")
    p.add_argument(
        "--host", help='only workers running on this host, e.g. --host "$(hostname)" in a container health check'
    )
    p.add_argument(
        "--ready",
        action="store_true",
        help="also require the worker past start-up (model loaded): for startup and readiness probes",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing, just set the exit code")


def run(args: argparse.Namespace) -> int:
    import redis

    from worker import preflight
    from worker.logs import mask_url
    from worker.stream.health import fresh_heartbeats, is_ready, of_group

    # unknown TRIAGE_ names are `run`'s and `check`'s business: a probe must not turn a worker unhealthy
    settings, problems = preflight.load_settings(unknown=False)
    for flag, value in (("--consumer", args.consumer), ("--host", args.host)):
        if value is not None and not value.strip():  # `--consumer "$(hostname)"` where it printed nothing
            problems.append(preflight.Problem(flag, "is empty (an unset variable?): name one, or leave the flag out"))
    if problems:
        for p in problems:
            print(f"triage-worker healthcheck: {p}", file=sys.stderr)
        return preflight.EXIT_CONFIG
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        found = list(fresh_heartbeats(client, settings.heartbeat_key_prefix, args.consumer))
        others = 0
        if not args.consumer:
            mine = [(c, beat) for c, beat in found if of_group(beat, settings.input_stream, settings.group)]
            others, found = len(found) - len(mine), mine
        if args.host:
            found = [(c, beat) for c, beat in found if beat.get("host") == args.host]
        if args.ready:
            found = [(c, beat) for c, beat in found if is_ready(beat)]
    except redis.exceptions.NoPermissionError as e:  # the probe's ACL: reachable, but it may not read the beats
        if not args.quiet:
            print(
                f"unhealthy: the Redis user may not read the heartbeats ({e}); grant the ops ACL line "
                "(docs/reliability.md, Security)",
                file=sys.stderr,
            )
        return 1
    except redis.RedisError as e:
        if not args.quiet:
            print(f"unhealthy: cannot reach Redis at {mask_url(settings.redis_url)}: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        for consumer, beat in found:
            print(json.dumps({"consumer": consumer, **beat}))
        if not found:
            who = f"consumer {args.consumer!r}" if args.consumer else "any worker"
            who += f" on host {args.host!r}" if args.host else ""
            what = "no fresh heartbeat past start-up" if args.ready else "no fresh heartbeat"
            where = f"stream {settings.input_stream!r}, group {settings.group!r}" if not args.consumer else ""
            print(
                f"unhealthy: {what} for {who} under {settings.heartbeat_key_prefix!r}"
                + (f" on {where}" if where else "")
                + (f" ({others} fresh on other streams or groups)" if others else ""),
                file=sys.stderr,
            )
    return 0 if found else 1
