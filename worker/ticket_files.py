"""Read tickets from JSON Lines (``text`` field) or CSV (``text`` column) files."""

from __future__ import annotations

import csv
import json
from pathlib import Path


class TicketFileError(ValueError):
    pass


def read_tickets(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows as dicts with at least ``text``; ``id``/``label``/others are kept. Line numbers in errors.

    UTF-8 with or without a byte-order mark: spreadsheet exports (Excel's "CSV UTF-8") start with one, which
    made the first CSV column ``\ufefftext`` and the first JSON line invalid. ``limit`` 0 reads nothing."""
    path = Path(path)
    rows: list[dict] = []
    if limit is not None and limit <= 0:
        return rows
    with path.open(encoding="utf-8-sig", newline="") as f:
        if path.suffix.lower() == ".csv":
            reader = csv.DictReader(f)
            if not reader.fieldnames or "text" not in reader.fieldnames:
                raise TicketFileError(f"{path}: CSV needs a 'text' column (found {reader.fieldnames})")
            for row in reader:
                rows.append(dict(row))
                if limit is not None and len(rows) >= limit:
                    break
        else:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TicketFileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict) or "text" not in row:
                    raise TicketFileError(f"{path}:{n}: expected an object with a 'text' field")
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    return rows
