"""The model cache under TRIAGE_CACHE_DIR (default ~/.cache/triage): list it, clean it.

Each conversion of a GGUF model (``gguf/``; the bundled SmolLM2: about 520 MB of fp32 safetensors)
and each unzipped packaged model (``bundled/``; MiniLM: about 90 MB) is kept so later starts load in
a second. Both are keyed by their source file's content, so the same file in several virtualenvs
shares one entry; older path-keyed ones, entries whose source is gone, and unfinished ones left by
a killed start are "stale" or "partial" and can go.
"""

from __future__ import annotations

import argparse
import sys
import time

NAME = "cache"
HELP = "list or clean the converted and unzipped model cache (TRIAGE_CACHE_DIR)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="every cached model: size, status (in-use / stale / partial), source GGUF or zip")
    c = sub.add_parser("clean", help="remove stale and unfinished entries (in-use ones stay unless --all)")
    c.add_argument("--all", action="store_true", help="remove every entry (the next start converts or unzips again)")
    c.add_argument("--dry-run", action="store_true", help="only say what would be removed")


def run(args: argparse.Namespace) -> int:
    from worker import preflight
    from worker.engine.model_cache import cache_entries, clean_cache

    settings = preflight.settings_or_exit("triage-worker cache", check_redis_url=False)
    root = settings.cache_dir
    entries = cache_entries(settings.cache_dir)
    if args.action == "list":
        for e in entries:
            age_d = (time.time() - e.modified_s) / 86400
            print(f"{_mb(e.size_bytes):>9}  {e.status:<7} {age_d:6.1f} d  {e.path}  <- {e.source or '?'}")
        total = sum(e.size_bytes for e in entries)
        print(f"{len(entries)} cached model(s), {_mb(total)} under {root}", file=sys.stderr)
        return 0
    if args.dry_run:
        going = [e for e in entries if args.all or e.status == "stale" or e.status == "partial"]
    else:
        going = clean_cache(settings.cache_dir, everything=args.all)
    for e in going:
        print(f"{'would remove' if args.dry_run else 'removed'} {_mb(e.size_bytes):>9}  {e.status:<7} {e.path}")
    print(
        f"{'would free' if args.dry_run else 'freed'} {_mb(sum(e.size_bytes for e in going))} "
        f"({len(going)} of {len(entries)} cached model(s)) under {root}",
        file=sys.stderr,
    )
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
