"""Argument types of ``triage-producer``: bad values are usage errors (exit 2) before anything connects."""

from __future__ import annotations

import argparse
import math


def at_least(floor: int):
    """An argparse type: a whole number >= ``floor`` (``--limit 0`` sent one ticket, ``synth --n -1`` raised)."""

    def parse(text: str) -> int:
        n = int(text)
        if n < floor:
            raise argparse.ArgumentTypeError(f"must be at least {floor}, got {n}")
        return n

    parse.__name__ = "number"  # argparse names the type in its message for a non-number: "invalid number value"
    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0 (``inf`` and ``nan`` ended in a traceback)."""
    s = float(text)
    if not math.isfinite(s) or s < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return s


seconds.__name__ = "seconds"


def entry_id_arg(text: str) -> str:
    """An argparse type: ``$`` or a stream entry id (``0``, ``<ms>``, ``<ms>-<seq>``); else a usage error, not a
    Redis error after connecting."""
    from producer.streams import is_since

    if not is_since(text):
        raise argparse.ArgumentTypeError(f"expected '$', '0' or an entry id such as 1700000000000-0, got {text!r}")
    return text


entry_id_arg.__name__ = "entry id"
