"""Argument types shared by the CLIs: a bad value is a usage error (exit 2) before anything loads or connects."""

from __future__ import annotations

import argparse


def at_least(floor: int):
    """An argparse type: a whole number >= ``floor`` (``--limit 0`` sent one ticket, ``synth --n -1`` raised;
    ``verify --limit 0`` loaded the model to check nothing)."""

    def parse(text: str) -> int:
        n = int(text)
        if n < floor:
            raise argparse.ArgumentTypeError(f"must be at least {floor}, got {n}")
        return n

    parse.__name__ = "number"  # argparse names the type in its message for a non-number: "invalid number value"
    return parse
