"""``python -m tests.run_worker <args>``: ``python -m worker <args>`` with ``TRIAGE_TEST_PRELOAD``'s module imported
first (a test's hook into the real worker, e.g. tests.held_passes). The exec'd twin of tests.zygote's preload."""

from __future__ import annotations

import importlib
import os
import sys

if __name__ == "__main__":
    if os.environ.get("TRIAGE_TEST_PRELOAD"):
        importlib.import_module(os.environ["TRIAGE_TEST_PRELOAD"])
    from worker.cli import main

    sys.exit(main(sys.argv[1:]))
