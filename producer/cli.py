"""``triage-producer``: send tickets, make synthetic ones, read and wait for results, run the demo.

Configured by the same TRIAGE_* environment as the worker (``ProducerSettings``);
``--redis-url`` overrides TRIAGE_REDIS_URL for one command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import redis

from producer.arg_types import at_least, entry_id_arg, seconds
from producer.ids_file import read_submissions, write_ids
from producer.redis_errors import partial as _partial
from worker.wording import count_of

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BACKLOG = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it


class ConfigError(Exception):
    """Settings the producer cannot work with; each line names the env var (or flag) to fix."""


class BadInput(Exception):
    """An input file (or output path) a command cannot use, found before anything is sent: exit 2."""


def _settings(args):
    from producer.settings import ProducerSettings
    from worker import preflight

    settings, problems = preflight.load_settings(ProducerSettings, redis_url=getattr(args, "redis_url", None))
    if problems:
        if getattr(args, "redis_url", None):
            problems = [
                preflight.Problem("--redis-url", p.message) if p.where == "TRIAGE_REDIS_URL" else p for p in problems
            ]
        raise ConfigError("\n".join(str(p) for p in problems))
    return settings


def _client(args):
    from producer.client import TriageClient

    return TriageClient(_settings(args))


def _submit_with_bar(client, tickets: list, desc: str) -> list:
    from tqdm import tqdm

    with tqdm(total=len(tickets), desc=desc, unit="ticket", file=sys.stderr, disable=None) as bar:
        return client.submit_many(tickets, on_progress=bar.update)


def _print_json(obj) -> None:
    """One JSON line; \\u escapes where the text cannot be printed as it is (a lone surrogate a result echoes
    from an older worker's meta, a terminal that is not UTF-8): a line, never a UnicodeEncodeError."""
    line = json.dumps(obj, ensure_ascii=False)
    try:
        line.encode(sys.stdout.encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        line = json.dumps(obj, ensure_ascii=True)
    print(line, flush=True)


# ----------------------------------------------------------------- commands
def cmd_send(args) -> int:
    numbered = _read_rows(args.file, args.limit)
    rows = [row for _, row in numbered]
    from producer.client import BacklogFull, InvalidTicket

    client = _client(args)
    if args.wait_s:  # the streams the wait reads: one of another type is said before anything is sent
        from producer.redis_errors import WrongType

        try:
            client.outcome_tails()
        except WrongType as e:
            e.submitted = []  # type: ignore[attr-defined]  # as the client marks a stopped send: nothing went
            raise
    with _open_ids_out(args.ids_out) as ids_out:
        try:
            sent = _submit_with_bar(client, rows, f"send {Path(args.file).name}")
        except InvalidTicket as e:  # the rows are checked before the first chunk goes: nothing was sent
            line = numbered[e.index][0]  # the line an editor shows, not the row's position (blank lines, CSV quotes)
            where = f"{args.file}:{line}: ticket {e.index + 1} of the file"
            raise BadInput(f"{where}: {e.reason}; nothing was sent") from None
        except (BacklogFull, redis.RedisError, KeyboardInterrupt) as e:  # what did go, to resume after (main reports)
            if getattr(e, "submitted", None):  # none: an earlier file stays as it was
                write_ids(ids_out, e.submitted)
            raise
        write_ids(ids_out, sent)
    print(f"sent {count_of(len(sent), 'ticket')} to {client.settings.input_stream} (backlog now {client.backlog()})")
    if args.wait_s:
        return _report_wait(client, sent, args.wait_s, quiet=True)
    return EXIT_OK


def _read_rows(path: str, limit: int | None) -> list[tuple[int, dict]]:
    """The file's tickets with the line each starts on, or ``BadInput`` (exit 2) for what ended in a traceback: a
    file that is not UTF-8 (a Latin-1 export), a CSV field over the csv module's size limit, a quote nothing closes."""
    from worker.ticket_files import TicketFileError, read_numbered

    try:
        return read_numbered(path, limit=limit)
    except (OSError, TicketFileError) as e:  # not UTF-8, an unreadable CSV, a bad row: one line each
        raise BadInput(str(e)) from None


def _open_ids_out(path: str | None):
    """The ``--ids-out`` file, opened before anything is sent: a path that cannot be written failed only after
    the send, losing the ids of what went. Opened to append, so a send that stops before anything went (a bad row,
    Redis unreachable, the backlog full, Ctrl-C) leaves an earlier file as it was; ``_write_ids`` replaces it."""
    try:
        return open(path, "a", encoding="utf-8") if path else contextlib.nullcontext()
    except OSError as e:
        raise BadInput(f"--ids-out: {e}; nothing was sent") from None


def cmd_synth(args) -> int:
    from producer.synth import generate_tickets

    tickets = generate_tickets(args.n, seed=args.seed)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            for t in tickets:
                f.write(json.dumps(t, ensure_ascii=False) + "\n")
        print(f"wrote {count_of(len(tickets), 'ticket')} to {args.out}", file=sys.stderr)
    if args.send:
        client = _client(args)
        payload = [{"id": t["id"], "text": t["text"], "meta": {"synthetic_label": t["label"]}} for t in tickets]
        sent = _submit_with_bar(client, payload, "send synthetic")
        print(
            f"sent {count_of(len(sent), 'synthetic ticket')} to {client.settings.input_stream} "
            f"(backlog now {client.backlog()})"
        )
    if not args.out and not args.send:
        for t in tickets:
            _print_json(t)
    return EXIT_OK


def cmd_results(args) -> int:
    client = _client(args)
    if not args.follow:
        for r in client.recent_results(args.count or 20, dead_letters=args.dead_letters):
            _print_json(r.to_dict())
        return EXIT_OK
    printed = 0
    try:
        for r in client.follow_results(since=args.since, dead_letters=args.dead_letters):
            _print_json(r.to_dict())
            printed += 1
            if args.count and printed >= args.count:
                break
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _report_wait(client, tickets: list, timeout_s: float, *, quiet: bool = False) -> int:
    """Wait for ``tickets`` (ids, or Submitted: then each result must answer that very submission)."""
    from producer.client import Submitted

    got = client.wait(tickets, timeout_s=timeout_s)
    ids = list(dict.fromkeys(t.ticket_id if isinstance(t, Submitted) else t for t in tickets))
    if quiet:
        labels = Counter(r.label if r.ok else f"({r.status})" for r in got.values())
        print(f"{len(got)}/{len(ids)} results: " + ", ".join(f"{k} {v}" for k, v in labels.most_common()))
    else:
        for tid in ids:
            if tid in got:
                _print_json(got[tid].to_dict())
    missing = [t for t in ids if t not in got]
    for tid in missing[:20]:
        print(f"timed out after {timeout_s}s: {tid}", file=sys.stderr)
    if len(missing) > 20:
        print(f"... and {len(missing) - 20} more timed out", file=sys.stderr)
    return EXIT_FAILED if missing else EXIT_OK


def cmd_wait(args) -> int:
    tickets: list = list(args.ids)
    if args.from_file:
        try:
            tickets += read_submissions(args.from_file)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(
                f"triage-producer wait: cannot read {args.from_file} (JSON lines with id and stream_id, "
                f"as written by send --ids-out): {e}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if not tickets and not args.from_file:  # an empty --ids-out file (nothing was sent) is nothing to wait for
        print("triage-producer wait: give ticket ids or --from-file", file=sys.stderr)
        return EXIT_USAGE
    return _report_wait(_client(args), tickets, args.timeout_s)


def cmd_backlog(args) -> int:
    client = _client(args)
    s = client.settings
    print(
        f"{client.backlog()} tickets waiting in {s.input_stream} "
        f"(limit {s.input_max_backlog or 'none'}, policy {s.backpressure})"
    )
    return EXIT_OK


def cmd_demo(args) -> int:
    from producer.demo import run_demo

    return run_demo(
        n=args.n,
        seed=args.seed,
        keep=args.keep,
        redis_url=args.redis_url,
        namespace=args.namespace,
        timeout_s=args.timeout_s,
        json_out=args.json,
    )


# ------------------------------------------------------------------- parser
def _version_line() -> str:
    from worker.cli import version_line

    return version_line("triage-producer")


def build_parser() -> argparse.ArgumentParser:
    from worker.redact import MaskingArgumentParser

    parser = MaskingArgumentParser(
        prog="triage-producer", description="Push support tickets to the triage worker and read its results."
    )
    parser.add_argument("--redis-url", help="overrides TRIAGE_REDIS_URL")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "send", help="send tickets from a JSON Lines or CSV file (field/column 'text'; optional id, subject, meta)"
    )
    p.add_argument("file")
    p.add_argument("--limit", type=at_least(1), help="send at most this many")
    p.add_argument("--ids-out", help="write {id, stream_id} JSON lines of what was sent here")
    p.add_argument(
        "--wait-s", type=seconds, default=0, help="then wait this long for the results and print label counts"
    )
    p.set_defaults(_run=cmd_send)

    p = sub.add_parser(
        "synth", help="generate realistic synthetic tickets (long-tailed lengths); print, save or send them"
    )
    p.add_argument("--n", type=at_least(0), default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write JSON Lines (id, text, label) to this file")
    p.add_argument(
        "--send", action="store_true", help="send them to the input stream (label goes into meta.synthetic_label)"
    )
    p.set_defaults(_run=cmd_synth)

    p = sub.add_parser(
        "results",
        help='print outcomes, one JSON object per line: results, and dead letters ("status": "dead_letter", '
        "with the reason)",
    )
    p.add_argument(
        "--count", type=at_least(1), help="how many (default: the last 20; with --follow: until interrupted)"
    )
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new outcomes as they arrive")
    p.add_argument(
        "--since",
        type=entry_id_arg,
        default="$",
        help="with --follow: start after this entry id, in both streams ('0' = from the start; default: only new)",
    )
    p.add_argument(
        "--no-dead-letters",
        dest="dead_letters",
        action="store_false",
        help="results only, not the dead-letter stream's records",
    )
    p.set_defaults(_run=cmd_results)

    p = sub.add_parser("wait", help="wait for the results of ticket ids; exit 1 if some did not arrive in time")
    p.add_argument("ids", nargs="*", help="ticket ids (each takes the latest result of that id)")
    p.add_argument(
        "--from-file",
        help="the --ids-out file of `send`: wait for the result of each of THOSE submissions "
        "(matched on stream_id, so a re-sent id never gets an earlier answer)",
    )
    p.add_argument("--timeout-s", type=seconds, default=30.0)
    p.set_defaults(_run=cmd_wait)

    p = sub.add_parser("backlog", help="how many tickets wait to be classified")
    p.set_defaults(_run=cmd_backlog)

    p = sub.add_parser("demo", help="end to end: (temp) Redis, synthetic tickets, a worker run --drain, a summary")
    p.add_argument(
        "--n", type=at_least(0), default=300, help="synthetic tickets to classify (plus 3 deliberately bad ones)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the demo's streams and keys afterwards")
    p.add_argument("--namespace", help="key prefix for the demo's streams (default: triage-demo:<random>:)")
    p.add_argument("--timeout-s", type=seconds, default=900.0, help="stop the worker after this long")
    p.add_argument("--json", help="also write the summary as JSON to this file")
    p.set_defaults(_run=cmd_demo)
    for p in sub.choices.values():  # after the command too (`backlog --redis-url URL`), as integrators type it
        p.add_argument("--redis-url", default=argparse.SUPPRESS, help="overrides TRIAGE_REDIS_URL")
    return parser


def main(argv: list[str] | None = None) -> int:
    from worker.redact import install_excepthook, register_env_secrets, register_url_secrets

    install_excepthook()
    register_env_secrets()
    args = build_parser().parse_args(argv)
    register_url_secrets(args.redis_url)
    from producer.client import BacklogFull
    from producer.redis_errors import WrongType

    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `triage-producer synth | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (ConfigError, BadInput) as e:
        for line in str(e).splitlines():
            print(f"triage-producer {args.command}: {line}", file=sys.stderr)
        return EXIT_USAGE
    except BacklogFull as e:
        print(f"triage-producer {args.command}: {e} ({len(e.submitted)} sent before that)", file=sys.stderr)
        return EXIT_BACKLOG
    except KeyboardInterrupt as e:  # Ctrl-C (`results --follow` handles its own): one line, what was sent
        print(f"triage-producer {args.command}: interrupted{_partial(e)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except WrongType as e:  # a stream setting naming a key of another type: a configuration error, as for the worker
        from producer.redis_errors import wrong_type_lines

        lines = wrong_type_lines(_settings(args), e)
        if lines:
            sent = ""
            if getattr(e, "submitted", None):  # a send stopped part-way (the key was replaced meanwhile)
                sent = _partial(e)
            elif hasattr(e, "submitted"):  # a send stopped at its first chunk
                sent = "; nothing was sent"
            for line in lines[:-1]:
                print(f"triage-producer {args.command}: {line}", file=sys.stderr)
            print(f"triage-producer {args.command}: {lines[-1]}{sent}", file=sys.stderr)
            return EXIT_USAGE
        print(f"triage-producer {args.command}: Redis error: {e}{_partial(e)}", file=sys.stderr)
        return EXIT_FAILED
    except redis.exceptions.NoPermissionError as e:  # the user's ACL is too narrow: a configuration error
        from producer.redis_errors import refused_line

        print(f"triage-producer {args.command}: {refused_line(e)}{_partial(e)}", file=sys.stderr)
        return EXIT_USAGE
    except redis.ConnectionError as e:
        from worker.redact import mask_secrets

        url = mask_secrets(args.redis_url or os.environ.get("TRIAGE_REDIS_URL") or "redis://127.0.0.1:6379/0")
        print(f"triage-producer {args.command}: cannot reach Redis at {url}: {e}{_partial(e)}", file=sys.stderr)
        return EXIT_FAILED
    except redis.RedisError as e:  # a timeout, OOM, a denied command: one line, not a traceback
        from worker.redact import mask_secrets

        why = mask_secrets(f"{type(e).__name__}: {e}")
        print(f"triage-producer {args.command}: Redis error: {why}{_partial(e)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
