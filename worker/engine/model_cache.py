"""What the model cache under TRIAGE_CACHE_DIR holds, and cleaning it, without loading anything (``cache``).

Two folders, both made by the loader and keyed by their source file's content (sources.py):
``gguf/`` (GGUF models converted to safetensors) and ``bundled/`` (packaged model zips, unzipped).
Only folders the loader made inside these two are listed or removed, never anything else.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.engine.sources import SOURCE_FILE, bundled_root, converted_target, gguf_root, is_converted, unzipped_target


@dataclass(frozen=True)
class _Area:
    root: Callable[[Path], Path]  # cache_dir -> the folder
    staging: str  # name prefix of an unfinished entry (loader._staged_dir)
    target: Callable[[Path, Path], Path]  # (source file, cache_dir) -> the entry it makes
    done: Callable[[Path], bool]  # entry folder -> finished?


AREAS = (
    _Area(gguf_root, ".convert-", converted_target, is_converted),
    _Area(bundled_root, ".unzip-", unzipped_target, lambda d: (d / "config.json").is_file()),
)


@dataclass
class CacheEntry:
    path: Path
    size_bytes: int
    source: str | None  # the GGUF or zip it was made from (as recorded), if known
    status: str  # "in-use" (a source on this machine maps here) | "stale" (source gone or changed) | "partial"
    modified_s: float


def _tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _live_keys(root: Path) -> set[str]:
    """Keys of source files that still exist unchanged (from the area's index.json: one line per path ever used)."""
    try:
        index = json.loads((root / "index.json").read_text())
    except (OSError, ValueError):
        return set()
    live = set()
    for stamp, key in index.items() if isinstance(index, dict) else []:
        try:
            p, size, mtime = stamp.rsplit("|", 2)
            st = os.stat(p)
            if st.st_size == int(size) and st.st_mtime_ns == int(mtime):
                live.add(key)
        except (OSError, ValueError):
            continue
    return live


def _recorded_source(d: Path) -> str | None:
    try:
        data = json.loads((d / SOURCE_FILE).read_text())
        return data.get("gguf") or data.get("zip")
    except (OSError, ValueError, AttributeError):
        return None


def cache_entries(cache_dir: Path) -> list[CacheEntry]:
    """Every folder in the cache's areas (symlinks aside: the cache makes none), with why it is kept or could go."""
    out = []
    for area in AREAS:
        root = area.root(cache_dir)
        if not root.is_dir():
            continue
        live = _live_keys(root)
        for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
            source, status = _recorded_source(d), "stale"
            if d.name.startswith(area.staging) or not area.done(d):
                status = "partial"
            elif d.name.rsplit("-", 1)[-1] in live:  # some source file on this machine (any venv) maps here
                status = "in-use"
            elif source and Path(source).is_file():
                try:
                    status = "in-use" if area.target(Path(source), cache_dir) == d else "stale"
                except OSError:
                    status = "stale"
            out.append(CacheEntry(d, _tree_size(d), source, status, d.stat().st_mtime))
    return out


def clean_cache(cache_dir: Path, *, everything: bool = False, min_age_s: float = 3600.0) -> list[CacheEntry]:
    """Remove stale entries (source gone, or made under an older key) and unfinished ones older than ``min_age_s``
    (one may be in the making right now); ``everything`` removes all. Returns what went."""
    gone = []
    now = time.time()
    for e in cache_entries(cache_dir):
        if everything or e.status == "stale" or (e.status == "partial" and now - e.modified_s > min_age_s):
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(e)
    if everything:
        for area in AREAS:
            (area.root(cache_dir) / "index.json").unlink(missing_ok=True)
    return gone
