"""worker.ticket_files.read_tickets: the files integrators and the eval/fit/verify commands hand it."""

from __future__ import annotations

import pytest

from worker.ticket_files import TicketFileError, read_tickets

BOM = "\ufeff"


@pytest.mark.parametrize(
    "name, content",
    [
        ("export.csv", BOM + "text,id\nI was charged twice,T-1\nwhere is my parcel,T-2\n"),
        (
            "export.jsonl",
            BOM + '{"text": "I was charged twice", "id": "T-1"}\n{"text": "where is my parcel", "id": "T-2"}\n',
        ),
    ],
)
def test_a_file_that_starts_with_a_byte_order_mark_reads_like_one_without(tmp_path, name, content):
    """Excel's "CSV UTF-8" export starts with a BOM: the CSV's first column was ``\\ufefftext`` (refused: no 'text'
    column) and the first JSON line was invalid JSON."""
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    rows = read_tickets(path)
    assert [(r["id"], r["text"]) for r in rows] == [("T-1", "I was charged twice"), ("T-2", "where is my parcel")]
    path.write_text(content.removeprefix(BOM), encoding="utf-8")
    assert read_tickets(path) == rows


def test_limit_counts_rows_and_zero_reads_none(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"text": "ticket {i}"}}\n\n' for i in range(5)), encoding="utf-8")
    assert [r["text"] for r in read_tickets(path, limit=2)] == ["ticket 0", "ticket 1"]
    assert read_tickets(path, limit=0) == []  # it returned the first row
    assert len(read_tickets(path)) == 5


def test_a_bad_line_is_named_by_its_line_number(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "ok"}\n\n{"txt": "no text"}\n', encoding="utf-8")
    with pytest.raises(TicketFileError, match=r"t\.jsonl:3: expected an object with a 'text' field"):
        read_tickets(path)
