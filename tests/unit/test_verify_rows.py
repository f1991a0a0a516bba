"""``triage-worker verify``'s tickets and the ids its report names them by (``commands.verify.read_rows``).

``str(row.get("id", i))`` made an object id of a JSON Lines file the id "{'a': 1}" and a null one "None": a flip
reported under an id that is in no file. Such ids are refused, naming the file's line (as the producer does), and
a file that cannot be read is one line too, not a traceback. Pure: files in a temp dir, no model.
"""

from __future__ import annotations

import pytest

from worker.commands.verify import read_rows


def test_ids_are_the_files_own_or_the_rows_position(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"id": "T-1", "text": "a"}\n{"text": "b"}\n\n{"id": 7, "text": "c"}\n{"id": null, "text": "d"}\n',
        encoding="utf-8",
    )
    rows, ids = read_rows(path, None)
    assert [r["text"] for r in rows] == ["a", "b", "c", "d"]
    assert ids == ["T-1", "1", "7", "3"]


@pytest.mark.parametrize(
    ("given", "kind"),
    [('{"a": 1}', "a dict (a JSON object)"), ("[1, 2]", "a list (a JSON array)"), ("true", "a boolean")],
)
def test_an_id_that_is_no_string_or_number_is_refused_naming_its_line(tmp_path, given, kind):
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"id": "T-1", "text": "a"}}\n\n{{"id": {given}, "text": "b"}}\n', encoding="utf-8")
    with pytest.raises(ValueError) as e:
        read_rows(path, None)
    want = f"{path}:3: ticket 2 of the file: id must be a string or a finite number, got {kind}: "
    assert str(e.value).startswith(want), e.value


def test_a_file_that_cannot_be_read_is_a_value_error_naming_its_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "a"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not valid JSON"):
        read_rows(path, None)
