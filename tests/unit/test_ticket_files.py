"""worker.ticket_files.read_tickets: the files integrators and the eval/fit/verify commands hand it."""

from __future__ import annotations

import csv
import io

import pytest

from worker.ticket_files import TicketFileError, read_numbered, read_tickets

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


def test_rows_carry_the_file_line_they_start_on(tmp_path):
    """What an editor shows, not the row's position: blank lines (also CRLF ones) and quoted newlines in a CSV."""
    jl = tmp_path / "t.jsonl"
    jl.write_bytes(b'{"text": "a"}\r\n\r\n  \n{"text": "b"}\n\n{"text": "c"}')
    assert [(n, row["text"]) for n, row in read_numbered(jl)] == [(1, "a"), (4, "b"), (6, "c")]
    sheet = tmp_path / "t.csv"
    sheet.write_text('text,id\r\n"one\r\ntwo",A\r\n\r\nthree,B\r\n"four\nfive\nsix",C\r\nseven,D', encoding="utf-8")
    assert [(n, row["id"]) for n, row in read_numbered(sheet)] == [(2, "A"), (5, "B"), (6, "C"), (9, "D")]
    assert [(n, row["id"]) for n, row in read_numbered(sheet, limit=2)] == [(2, "A"), (5, "B")]


def test_csv_rows_are_what_csv_dictreader_makes(tmp_path):
    """Numbering the rows meant reading them without DictReader: short rows, long rows and blank lines come out as
    before (missing cells None, extra cells as a list under None)."""
    content = 'text,id,subject\nfull,A,S\nshort,B\nlong,C,S,x,y\n\n"quoted\nnewline",D,\n'
    sheet = tmp_path / "t.csv"
    sheet.write_text(content, encoding="utf-8")
    assert read_tickets(sheet) == list(csv.DictReader(io.StringIO(content, newline="")))
    sheet.write_text("", encoding="utf-8")
    with pytest.raises(TicketFileError, match="CSV needs a 'text' column"):
        read_tickets(sheet)


def test_an_unreadable_csv_row_names_its_line_and_is_still_a_csv_error(tmp_path):
    sheet = tmp_path / "t.csv"
    sheet.write_text('text,id\n"two\nlines",A\n"' + "a" * 200_000 + '",B\n', encoding="utf-8")
    with pytest.raises(csv.Error, match=r"t\.csv:4: unreadable CSV: field larger than field limit") as e:
        read_tickets(sheet)
    assert isinstance(e.value, TicketFileError)


def test_a_file_that_is_not_utf8_is_one_reason_for_every_caller(tmp_path):
    """send and verify each turned UnicodeDecodeError into the same sentence, and eval/fit showed a traceback: the
    reader says it once."""
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(TicketFileError, match=r"latin1\.jsonl: not UTF-8 text \(save it as UTF-8\)"):
        read_numbered(p)


def test_a_quote_nothing_closes_is_refused_at_the_line_its_field_opens(tmp_path):
    """The csv module reads it as a field to the end of the file: ``c1,"unterminated`` became a ticket, and one
    earlier in the file took every row after it into one. verify, eval and the producer read files this way."""
    f = tmp_path / "t.csv"
    f.write_text('id,text\nc0,"two\nlines"\nc1,"runs on\nc2,over the rest\n', encoding="utf-8")
    with pytest.raises(TicketFileError, match=r"t\.csv:4: unreadable CSV: a quoted field opens on this line"):
        read_tickets(f)
    assert [r["id"] for r in read_tickets(f, limit=1)] == ["c0"]  # the rows before it, when the limit stops there
    f.write_text('text,"note\nhello,a\n', encoding="utf-8")  # in the header: it read as 0 tickets, no error
    with pytest.raises(TicketFileError, match=r"t\.csv:1: unreadable CSV: a quoted field of the header row"):
        read_tickets(f)
    f.write_text('id,text\nc0,"said ""hi"""', encoding="utf-8")  # a quote closed at the very end of the file
    assert read_tickets(f) == [{"id": "c0", "text": 'said "hi"'}]
