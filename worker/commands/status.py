"""Show the worker group: backlog, pending, dead letters, recent throughput and latency, and one row per
worker (heartbeat age, phase, pending, idle). Read from Redis alone, like ``rq info``: run it from any
machine that reaches Redis; it loads no model, imports no torch and writes nothing.

Uses the same TRIAGE_* settings as the workers (stream, group, key prefixes). Its Redis user needs read rights
only: the ops ACL line of docs/reliability.md ("Security"), tested as written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

NAME = "status"
HELP = "show workers, backlog, pending, dead letters, recent throughput and latency (from Redis alone)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object (with --watch: one per line)")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes (0 = never)")
    p.add_argument(
        "--window-s",
        type=float,
        default=60.0,
        help="throughput, latency and recent dead letters over the last this many seconds (default 60)",
    )
    p.add_argument(
        "--max-results",
        type=int,
        default=2000,
        help="read at most this many recent results (the rate is then over the span they cover)",
    )


def run(args: argparse.Namespace) -> int:
    import redis

    from worker import key_checks, preflight
    from worker.logs import mask_url
    from worker.observability.status import Target

    # as for healthcheck: unknown TRIAGE_ names are `run`'s and `check`'s business
    s, problems = preflight.load_settings(unknown=False)
    if problems:
        for p in problems:
            print(f"triage-worker status: {p}", file=sys.stderr)
        return preflight.EXIT_CONFIG
    day_s = 86_400.0  # bounded: inf, nan or 1e10 s broke the stream-id arithmetic of the window (a traceback)
    if not (0 < args.interval_s <= day_s and 0 < args.window_s <= 7 * day_s) or args.max_results < 1:  # nan fails
        print(
            "triage-worker status: --interval-s must be in (0, 86400], --window-s in (0, 604800], --max-results >= 1",
            file=sys.stderr,
        )
        return preflight.EXIT_CONFIG
    url = mask_url(s.redis_url)
    target = Target(
        s.input_stream, s.group, s.results_stream, s.dead_letter_stream, s.heartbeat_key_prefix, s.claim_idle_ms
    )
    client = redis.Redis.from_url(  # the URL parses: load_settings checked it
        s.redis_url, socket_timeout=5, socket_connect_timeout=5, decode_responses=True, encoding_errors="replace"
    )
    try:
        return _loop(client, target, url, args, key_checks.stream_keys(s))
    except KeyboardInterrupt:  # Ctrl-C ends a watch
        return 0
    except BrokenPipeError:  # `status --json | head -1`, a watch whose reader left: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 0


def _loop(client, target, url: str, args: argparse.Namespace, streams: dict[str, str]) -> int:
    import redis

    from worker import key_checks, preflight
    from worker.observability.status import collect
    from worker.observability.status_view import render

    shown = 0
    clear = args.watch and not args.json and sys.stdout.isatty()
    while True:
        try:
            # a stream setting naming a key of another type is a configuration error (exit 2), not Redis trouble
            wrong = key_checks.stream_type_problems(client, streams)
            if wrong:
                for p in wrong:
                    print(f"triage-worker status: {p}", file=sys.stderr)
                return preflight.EXIT_CONFIG
            snap = collect(client, target, window_s=args.window_s, max_results=args.max_results)
        except redis.exceptions.NoPermissionError as e:  # the user's ACL is too narrow: configuration, not Redis down
            print(
                f"triage-worker status: the Redis user may not run a command status needs ({e}); grant the ops ACL "
                "line (docs/reliability.md, Security)",
                file=sys.stderr,
            )
            return preflight.EXIT_CONFIG
        except redis.RedisError as e:
            print(f"triage-worker status: cannot read Redis at {url}: {type(e).__name__}: {e}", file=sys.stderr)
            if not args.watch:
                return 1
            snap = None  # a watch outlives a Redis blip
        if snap is not None:
            if args.json:
                print(json.dumps({"redis": url, **snap}), flush=True)
            else:
                print(("\x1b[H\x1b[2J" if clear else "") + render(snap, url) + ("" if clear else "\n"), flush=True)
        shown += 1
        if not args.watch or (args.count and shown >= args.count):
            return 0 if snap is not None else 1  # a counted watch whose last refresh failed: Redis unreachable
        time.sleep(args.interval_s)
