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


def _named_sets(root):
    """A data directory with BANKING77's file layout: one file per split, rows without a split field."""
    (root / "banking77").mkdir(parents=True)
    for split in ("train", "test"):
        (root / "banking77" / f"banking77_{split}.jsonl").write_text(
            f'{{"text": "{split} one", "label": "a"}}\n{{"text": "{split} two", "label": "b"}}\n', encoding="utf-8"
        )
    return root


def test_a_named_set_without_a_split_is_the_test_file_to_measure_and_the_train_file_to_fit(tmp_path, monkeypatch):
    """`fit --input banking77` fitted on the test file and `--split train` was an error (the named files have no
    split field): the split now picks the file, and what a head is fitted on defaults to train."""
    from worker.quality import data

    monkeypatch.setenv("TRIAGE_DATA_DIR", str(_named_sets(tmp_path)))
    texts = lambda src: [r.text for r in src.rows]  # noqa: E731
    assert texts(data.resolve("banking77")) == ["test one", "test two"]
    assert texts(data.resolve("banking77", default_split="train")) == ["train one", "train two"]
    assert texts(data.resolve("banking77", split="train")) == ["train one", "train two"]
    assert texts(data.resolve("banking77:test", default_split="train")) == ["test one", "test two"]
    assert data.resolve("banking77", split="train").split is None  # the whole file is the split
    with pytest.raises(DataError, match="two splits"):
        data.resolve("banking77:test", split="train")


def test_seen_in_fit_compares_file_contents_and_splits(tmp_path):
    """A head records the rows it was fitted on (file hash, splits); eval marks a head scored on any of them."""
    from worker.quality import data

    f = tmp_path / "t.jsonl"
    f.write_text('{"text": "x", "label": "a", "split": "train"}\n{"text": "y", "label": "a", "split": "test"}\n')
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(f.read_bytes())
    train, test, whole = (data.resolve(str(f), split=s) for s in ("train", "test", None))
    fitted = [data.provenance(train)]
    assert fitted[0]["fitted_splits"] == ["train"]
    assert data.seen_in_fit(fitted, data.resolve(str(copy), split="train"))  # the same rows under another name
    assert data.seen_in_fit(fitted, whole)  # every row, the train ones among them
    assert not data.seen_in_fit(fitted, test)
    assert data.seen_in_fit([data.provenance(whole)], test)
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "z", "label": "a", "split": "train"}\n')
    assert not data.seen_in_fit(fitted, data.resolve(str(other), split="train"))
