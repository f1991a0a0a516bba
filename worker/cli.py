"""``triage-worker`` / ``python -m worker``: one subcommand per module in ``worker.commands``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines NAME, HELP, add_arguments(parser) and run(args) -> int.
COMMANDS = [
    "worker.commands.run",
    "worker.commands.healthcheck",
    "worker.commands.status",
    "worker.commands.check",
    "worker.commands.verify",
    "worker.commands.eval",
    "worker.commands.fit",
    "worker.commands.cache",
]


def build_parser() -> argparse.ArgumentParser:
    from worker.redact import MaskingArgumentParser

    parser = MaskingArgumentParser(
        prog="triage-worker", description="Classify support tickets from Redis in length-bucketed batches."
    )
    parser.add_argument("--version", action="version", version=version_line("triage-worker"))
    sub = parser.add_subparsers(dest="command", required=True)
    for path in COMMANDS:
        try:
            mod = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name == path:  # command not built yet
                continue
            raise
        # the module's docstring as written: its example command lines stay one per line
        p = sub.add_parser(
            mod.NAME, help=mod.HELP, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def version_line(prog: str) -> str:
    """``triage-worker 0.1.0 (Python 3.11.9)``: the installed package's version, without importing torch."""
    import platform

    try:
        from importlib.metadata import version

        v = version("triage")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        from worker import __version__ as v
    return f"{prog} {v} (Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    from worker.redact import install_excepthook, register_env_secrets

    install_excepthook()
    register_env_secrets()
    args = build_parser().parse_args(argv)
    from worker.engine.types import ConfigError

    try:
        return int(args._run(args) or 0)
    except ConfigError as e:  # settings that cannot work together: one line naming them, exit 2 (not a bug)
        print(f"triage-worker {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
