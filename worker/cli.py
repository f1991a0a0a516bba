"""``triage-worker`` / ``python -m worker``: one subcommand per module in ``worker.commands``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines NAME, HELP, add_arguments(parser) and run(args) -> int.
COMMANDS = [
    "worker.commands.run",
    "worker.commands.healthcheck",
    "worker.commands.check",
    "worker.commands.verify",
    "worker.commands.eval",
    "worker.commands.fit",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triage-worker", description="Classify support tickets from Redis in length-bucketed batches.")
    sub = parser.add_subparsers(dest="command", required=True)
    for path in COMMANDS:
        try:
            mod = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name == path:  # command not built yet
                continue
            raise
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from worker.redact import install_excepthook, register_env_secrets

    install_excepthook()
    register_env_secrets()
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
