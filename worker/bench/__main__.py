"""``python -m worker.bench``: the same as ``triage-bench``."""

from worker.bench.cli import main

raise SystemExit(main())
