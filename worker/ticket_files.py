"""Read tickets from JSON Lines (``text`` field) or CSV (``text`` column) files."""

from __future__ import annotations

import csv
import json
import re
import uuid
from pathlib import Path


class TicketFileError(ValueError):
    pass


class UnreadableCsv(TicketFileError, csv.Error):
    """A CSV the csv module cannot parse (a field over its size limit), with the line its row starts on; still a
    ``csv.Error`` for callers that catch that."""


def read_tickets(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows as dicts with at least ``text``; ``id``/``label``/others are kept. Line numbers in errors.

    UTF-8 with or without a byte-order mark: spreadsheet exports (Excel's "CSV UTF-8") start with one, which
    made the first CSV column ``\ufefftext`` and the first JSON line invalid. ``limit`` 0 reads nothing."""
    return [row for _, row in read_numbered(path, limit)]


def read_numbered(path: str | Path, limit: int | None = None) -> list[tuple[int, dict]]:
    """``read_tickets`` with the file line each row starts on: what an editor shows, which the row's position is
    not once a JSON Lines file has blank lines or a CSV field spans lines (a quoted newline)."""
    path = Path(path)
    if limit is not None and limit <= 0:
        return []
    out: list[tuple[int, dict]] = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = _csv_rows(path, f) if path.suffix.lower() == ".csv" else _jsonl_rows(path, f)
        try:
            for numbered in rows:
                out.append(numbered)
                if limit is not None and len(out) >= limit:
                    break
        except UnicodeDecodeError as e:  # a Latin-1 export: one reason for every caller, not a traceback
            raise TicketFileError(f"{path}: not UTF-8 text (save it as UTF-8): {e}") from None
    return out


def _jsonl_rows(path: Path, f):
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TicketFileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "text" not in row:
            raise TicketFileError(f"{path}:{n}: expected an object with a 'text' field")
        yield n, row


_BREAK = re.compile(r"\r\n|\r|\n")


def _then_end_mark(f, mark: str):
    """The file's lines, then ``mark``: a row of its own, unless a quoted field is still open at the end of the file,
    which the csv module (not strict) reads as a field running to the end, every line after it included."""
    yield from f
    yield mark


def _csv_rows(path: Path, f):
    """Rows as ``csv.DictReader`` makes them (extra cells under ``None``, missing ones ``None``), numbered: the
    reader's ``line_num`` before a row is the line above it (a blank line is a row of no cells, skipped). A quote
    nothing closes is refused: ``c1,"unterminated`` went out as a ticket, and one earlier in the file made every
    ticket after it part of one."""
    mark = f"end-of-file-{uuid.uuid4().hex}"  # no quote, comma or line break
    reader = csv.reader(_then_end_mark(f, mark))
    try:
        names = next(reader, None)
    except csv.Error as e:
        raise UnreadableCsv(f"{path}:1: unreadable CSV: {e}") from None
    if names == [mark]:  # an empty file
        names = None
    if names and names[-1].endswith(mark):  # the header's quote runs to the end: the whole file is one header
        raise UnreadableCsv(f"{path}:1: unreadable CSV: a quoted field of the header row never closes")
    if not names or "text" not in names:
        raise TicketFileError(f"{path}: CSV needs a 'text' column (found {names})")
    while True:
        start = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise UnreadableCsv(f"{path}:{start}: unreadable CSV: {e}") from None
        if not cells or cells == [mark]:
            continue
        if cells[-1].endswith(mark):  # the field opens after the line breaks of the row's earlier cells
            opens = start + sum(len(_BREAK.findall(c)) for c in cells[:-1])
            raise UnreadableCsv(
                f"{path}:{opens}: unreadable CSV: a quoted field opens on this line and no quote closes it (it would "
                "run to the end of the file); close the quote, or double each quote inside the field"
            )
        row: dict = dict(zip(names, cells))
        if len(cells) > len(names):
            row[None] = cells[len(names) :]
        for name in names[len(cells) :]:
            row[name] = None
        yield start, row
