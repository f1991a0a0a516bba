"""Run the long-lived worker: read tickets from the input stream (consumer group) in windows,
classify them in length-bucketed passes, write each pass's results + acks in one atomic step,
log one JSON line per pass and per window. Configured by TRIAGE_* environment variables (see
docs/worker.md).

First SIGTERM/SIGINT: finish and ack the windows in hand, exit 0. Second: exit at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

NAME = "run"
HELP = "run the Redis Streams worker (until a signal, or with --drain until the stream is empty)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain",
        "--burst",
        dest="drain",
        action="store_true",
        help="exit 0 once no entry is undelivered and none is pending (batch jobs, demos)",
    )
    p.add_argument(
        "--consumer", help="consumer name (default: TRIAGE_CONSUMER or <host>-<pid>; must be unique per process)"
    )


def run(args: argparse.Namespace) -> int:
    from worker import preflight
    from worker.logs import configure_logging, get_logger, mask_url
    from worker.observability import prometheus

    # Before torch and the model: settings, TRIAGE_ names, task file, model location, Redis URL.
    settings, problems = preflight.load_settings(consumer=args.consumer)
    configure_logging(
        settings.log_format if settings else preflight.log_format_from_env(),
        settings.log_level if settings else "INFO",
        static={"consumer": settings.consumer} if settings else None,  # every line, the libraries' and threads' too
    )
    log0 = get_logger("triage.worker")
    if settings is not None:
        problems += preflight.worker_problems(settings)
    if problems:
        for p in problems:  # one line each, naming the env var or file:line to fix
            log0.error("config_invalid", setting=p.where, error=str(p))
        return preflight.EXIT_CONFIG
    log0.info(  # before the heavy imports: torch alone takes seconds
        "worker_starting",
        consumer=settings.consumer,
        redis_url=mask_url(settings.redis_url),
        input_stream=settings.input_stream,
        group=settings.group,
        model=settings.model,
        window_max_items=settings.window_max_items,
        pass_max_items=settings.pass_max_items,
        max_wait_ms=settings.max_wait_ms,
        prefetch=settings.prefetch,
        drain=args.drain,
    )
    log = get_logger("triage.worker").bind(consumer=settings.consumer)
    if not prometheus.start_for(settings, log):
        return 2
    from worker.engine.types import ConfigError
    from worker.stream.loop import run_worker

    try:
        code = run_worker(settings, drain=args.drain)
    except ConfigError as e:  # found only once the model is loaded (a head for another prompt): one line, exit 2
        log.error(
            "config_invalid",
            setting=e.setting or "TRIAGE_SCORER / TRIAGE_HEAD_PATH",
            error=getattr(e, "text", None) or str(e),
        )
        code = preflight.EXIT_CONFIG
    except Exception:  # e.g. the model cannot be loaded: say so in the log format ops read
        log.exception("worker_failed")
        code = 1
    # Everything that matters is in Redis now. Skip interpreter teardown: with torch and
    # transformers loaded it takes seconds (3.3 s measured on a 2-core box), which every
    # stop, drain and rolling restart would pay.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
