"""Check the configuration without starting anything: TRIAGE_ variables (unknown names, with a
did-you-mean), setting values, the task file, the Redis URL, Redis itself (reachable, password,
stream key types, every command the worker sends allowed to its ACL user) and where the model and
the encoder (TRIAGE_ENCODER) come from; ``--model`` also loads them and classifies one ticket.
Prints one line per problem on stderr (what is fine on stdout); exit 0 if all is well, 2
otherwise. Runs in about a second without ``--model`` (no torch import).
"""

from __future__ import annotations

import argparse
import os
import sys

NAME = "check"
HELP = "validate settings, task file, Redis and the model's location (exit 0 ok, 2 problems); --model also loads it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", action="store_true", help="also load the model and classify one ticket (seconds to minutes)"
    )
    p.add_argument("--no-redis", action="store_true", help="do not contact Redis (check its URL only)")


def run(args: argparse.Namespace) -> int:
    from worker import key_checks, preflight
    from worker.redact import mask_secrets

    settings, problems = preflight.load_settings()
    ok: list[str] = []
    if settings is not None:
        if not problems:  # an unknown or misspelt TRIAGE_ name is a problem of the settings too
            ok.append(f"settings: ok (TRIAGE_ variables: {sum(k.startswith('TRIAGE_') for k in os.environ)} set)")
        found = preflight.worker_problems(settings)
        problems += found
        if not any(p.where in ("TRIAGE_TASK_FILE", "TRIAGE_LABELS") for p in found):
            ok.append(_task_line(settings))
        if not any(p.where == "TRIAGE_MODEL" for p in found):
            ok.append(f"model: {settings.model} found (not loaded{'' if args.model else '; --model loads it'})")
        if settings.encoder and not any(p.where == "TRIAGE_ENCODER" for p in found):
            ok.append(f"encoder: {settings.encoder} found, an encoder by its config (not loaded)")
        if not args.no_redis and not any(p.where == "TRIAGE_REDIS_URL" for p in problems):
            down = preflight.redis_problem(settings.redis_url)
            if down:
                problems.append(down)
            else:
                keys = key_checks.stream_key_problems(settings.redis_url, settings)
                refused = key_checks.permission_problems(settings.redis_url, settings)  # what `run` refuses to start on
                problems += keys + refused
                if not keys and not refused:
                    ok.append(
                        f"redis: {mask_secrets(settings.redis_url)} reachable; stream keys ok; its user may run every "
                        "command the worker sends"
                    )
                if "TRIAGE_CONSUMER" in os.environ:  # the default name (<hostname>-<pid>) is this process's own
                    ok.append(_consumer_line(settings, key_checks.consumer_holder(settings.redis_url, settings)))
        if args.model and not problems:
            ok.append(_load_model(settings, problems))
    for line in ok:
        if line:
            print(line)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(f"triage-worker check: {len(problems)} problem(s)", file=sys.stderr)
    return preflight.EXIT_CONFIG if problems else 0


def _consumer_line(settings, holder: dict | str | None) -> str:
    """Not a problem: the holder may be this deployment's own worker; a second one under the name is refused."""
    name = settings.consumer
    if holder is None:
        return f"consumer: {name} free (no worker's heartbeat under it)"
    if isinstance(holder, str):
        return f"consumer: {name} not checked (its heartbeat key could not be read: {holder})"
    from worker.stream.health import now_ms

    beat_at_ms = holder.get("beat_at_ms")
    age = (
        f"{(now_ms() - beat_at_ms) / 1000:.0f} s ago" if isinstance(beat_at_ms, (int, float)) else "at an unknown time"
    )
    return (
        f"consumer: {name} held by a worker (host {holder.get('host')}, pid {holder.get('pid')}, phase "
        f"{holder.get('phase')}, last beat {age}): while it beats, another `triage-worker run` under this name "
        "exits 2 (consumer_in_use); a dead one's key is waited out"
    )


def _task_line(settings) -> str:
    from worker.assemble import task_from_settings

    task = task_from_settings(settings)
    src = settings.task_file or ("TRIAGE_LABELS" if settings.labels else "built-in default")
    return f"task: {len(task.labels)} labels ({', '.join(task.labels)}), {len(task.examples)} examples, from {src}"


def _load_model(settings, problems: list) -> str:
    import time

    from worker import preflight
    from worker.logs import configure_logging

    configure_logging(settings.log_format, settings.log_level)
    t0 = time.perf_counter()
    from worker.engine.types import ConfigError

    try:
        from worker.assemble import build_classifier

        clf = build_classifier(settings)
        pred = clf.classify(clf.prepare_valid(["I was charged twice for my subscription"]))[0][0]
    except ConfigError as e:  # found once the model is loaded, but the setting it names is the one to change
        problems.append(preflight.Problem(e.setting or "TRIAGE_MODEL", getattr(e, "text", None) or str(e)))
        return ""
    except Exception as e:  # noqa: BLE001 - any load failure is the answer to "does the model work"
        problems.append(preflight.Problem("TRIAGE_MODEL", f"failed to load or run: {type(e).__name__}: {e}"))
        return ""
    return (
        f"model: {clf.model_name} loaded on {clf.device} ({clf.dtype_name}) in {time.perf_counter() - t0:.1f} s; "
        f"a test ticket got {pred.label!r}"
    )
