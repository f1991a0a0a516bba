"""A scorer head file's metadata, read from its safetensors header without numpy or torch (``check`` runs before
either is imported): enough to refuse a corrupt, foreign or newer-format file before the worker starts.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON (tensor names, dtypes, shapes,
offsets, and ``__metadata__``), then the tensor data. A head keeps its own JSON under ``__metadata__.triage_head``.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "triage-head/1"
TENSORS = ("mean", "std", "weight", "bias")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own cap


def safetensors_header(f, size: int) -> bytes | None:
    """The JSON header of the safetensors file open as ``f`` (``size`` bytes long), or None: it is no such file."""
    f.seek(0)
    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
    if not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
        return None
    return f.read(n)


def head_file_problem(path: Path) -> str | None:
    """Why ``path`` is no scorer head this version reads (None: its header says it is one)."""
    try:
        with open(path, "rb") as f:
            raw = safetensors_header(f, path.stat().st_size)
            if raw is None:
                return f"{path} is not a safetensors file (a scorer head from `triage-worker fit`)"
            header = json.loads(raw)
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError):
        return f"{path} is not a safetensors file (a scorer head from `triage-worker fit`): its header is no JSON"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (a scorer head from `triage-worker fit`)"
    raw_meta = (header.get("__metadata__") or {}).get("triage_head")
    if raw_meta is None:
        return f"{path} is not a triage scorer head (no 'triage_head' metadata): a model's weights?"
    try:
        meta = json.loads(raw_meta)
    except ValueError:
        return f"{path}: its 'triage_head' metadata is no JSON"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        return f"{path}: unsupported head format {got!r} (this version reads {FORMAT})"
    missing = [t for t in TENSORS if t not in header]
    if missing:
        return f"{path}: a head without its {', '.join(missing)} tensor(s)"
    return None
