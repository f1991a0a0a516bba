"""Argument types of ``triage-producer``: bad values are usage errors (exit 2) before anything connects."""

from __future__ import annotations

import argparse
import math

from worker.commands.arg_types import at_least

__all__ = ["at_least", "entry_id_arg", "seconds"]


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
