"""Importing this module leaves a file at $TRIAGE_TEST_PROBE_FILE: proof that a callback path naming it was imported."""

import os
from pathlib import Path

if os.environ.get("TRIAGE_TEST_PROBE_FILE"):
    Path(os.environ["TRIAGE_TEST_PROBE_FILE"]).touch()


def anything(*args, **kwargs):
    """A callback that must never be called."""
