"""``worker.quality.data.load_labelled`` names a bad row by its file line (``file:line``), as an editor shows it.

It said ``row N``, the row's position: another line once a JSON Lines file has blank lines or a CSV field spans
lines (a quoted newline), so the message pointed at the wrong line of the file. Pure: files in a temp dir.
"""

from __future__ import annotations

import pytest

from worker.quality.data import DataError, load_labelled


def test_a_jsonl_row_is_named_by_its_line_across_blank_lines(tmp_path):
    path = tmp_path / "labelled.jsonl"
    path.write_text(
        '{"text": "refund please", "label": "billing"}\n\n\n{"text": "app crashes", "label": ""}\n',
        encoding="utf-8",
    )
    with pytest.raises(DataError) as e:
        load_labelled(path)
    assert str(e.value) == f"{path}:4: no 'label'"


def test_a_csv_row_is_named_by_the_line_it_starts_on_after_a_field_over_two_lines(tmp_path):
    path = tmp_path / "labelled.csv"
    path.write_text('text,label\n"charged\ntwice",billing\nwhere is it,shipping\nlogin fails\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_labelled(path)  # the third row (a cut-short row: no label cell) starts on line 5, not "row 3"
    assert str(e.value) == f"{path}:5: no 'label'"
    path.write_text('text,label\n"charged\ntwice",billing\n', encoding="utf-8")
    assert [(r.text, r.label) for r in load_labelled(path)] == [("charged\ntwice", "billing")]


def test_a_text_that_is_no_string_is_named_by_its_line(tmp_path):
    path = tmp_path / "labelled.jsonl"
    path.write_text('\n{"text": "ok", "label": "billing"}\n\n{"text": 7, "label": "other"}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_labelled(path)
    assert str(e.value) == f"{path}:4: 'text' must be a string, got int"
