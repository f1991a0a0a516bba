"""Metrics against hand-computed values; few-shot picking and labelled-data loading (pure logic)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from worker.engine.task import default_task, load_task_file
from worker.quality import data, metrics
from worker.quality.fewshot import pick_examples, task_to_dict, write_task_file

LABELS = ["a", "b", "c"]


def test_confusion_accuracy_macro_f1_and_per_label_match_hand_computation():
    y_true = ["a", "a", "a", "b", "b", "c"]
    y_pred = ["a", "a", "b", "b", "c", "needs_review"]
    rep = metrics.evaluate(y_true, y_pred, LABELS)
    assert rep.confusion == [[2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]  # last column: not a label (fallback)
    assert rep.accuracy == pytest.approx(3 / 6)
    assert rep.precision == pytest.approx({"a": 1.0, "b": 0.5, "c": 0.0})
    assert rep.recall == pytest.approx({"a": 2 / 3, "b": 0.5, "c": 0.0})
    f1_a = 2 * 1.0 * (2 / 3) / (1.0 + 2 / 3)
    assert rep.macro_f1 == pytest.approx((f1_a + 0.5 + 0.0) / 3)
    assert rep.support == {"a": 3, "b": 2, "c": 1}


def test_labels_without_support_are_left_out_of_macro_f1():
    rep = metrics.evaluate(["a", "a"], ["a", "a"], LABELS)
    assert rep.macro_f1 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not one of"):
        metrics.evaluate(["zzz"], ["a"], LABELS)


def test_ece_is_zero_when_confidence_matches_accuracy_and_large_when_overconfident():
    conf = np.array([0.75] * 8)
    right = np.array([1, 1, 1, 0, 1, 1, 1, 0], dtype=float)  # 75% right at 0.75 confidence
    assert metrics.expected_calibration_error(conf, right) == pytest.approx(0.0)
    assert metrics.expected_calibration_error(np.array([0.99] * 4), np.array([1, 0, 0, 0.0])) == pytest.approx(0.74)
    # two bins, each off by 0.1, weighted by size
    e = metrics.expected_calibration_error(np.array([0.95, 0.95, 0.35, 0.35, 0.35]), np.array([1, 1, 1, 0, 0.0]))
    assert e == pytest.approx((2 * 0.05 + 3 * abs(1 / 3 - 0.35)) / 5)


def test_selective_accuracy_reports_coverage_and_accuracy_above_threshold():
    sel = metrics.selective_accuracy([0.9, 0.8, 0.4, 0.2], [True, False, True, False], [0.5, 0.95])
    assert sel[0] == {"threshold": 0.5, "coverage": 0.5, "accuracy": 0.5}
    assert sel[1] == {"threshold": 0.95, "coverage": 0.0, "accuracy": None}


def test_pick_examples_is_seeded_interleaved_and_capped_by_available(tmp_path):
    rows = [data.Labelled(f"{lab} text {i}", lab) for lab in "xyz" for i in range(6)] + [data.Labelled("only one", "w")]
    a = pick_examples(rows, 2, seed=3)
    assert a == pick_examples(rows, 2, seed=3)
    assert a != pick_examples(rows, 2, seed=4)
    counts = {lab: sum(e.label == lab for e in a) for lab in "wxyz"}
    assert counts == {"w": 1, "x": 2, "y": 2, "z": 2}
    # round-robin: the first round holds one example of every label
    assert sorted(e.label for e in a[:4]) == ["w", "x", "y", "z"]
    with pytest.raises(ValueError):
        pick_examples(rows, 0)


def test_task_file_with_examples_round_trips_through_the_engine_loader(tmp_path):
    task = default_task()
    for name in ("task.yaml", "task.json"):
        write_task_file(task, tmp_path / name)
        back = load_task_file(tmp_path / name)
        assert back == task
    assert task_to_dict(task)["examples"][0]["label"] == "billing"


def test_an_example_holding_a_nel_character_round_trips_through_the_yaml_task_file(tmp_path):
    """U+0085 (NEL: cp1252's "..." decoded as Latin-1, a common export slip) was written raw and read back as a line
    break, a space: fit's --examples-out wrote a task whose prompt was not the head's (verify: exit 2)."""
    task = default_task()
    text = "Calendar invites created in your tool show up one hour off in Outlook, I think it's a timezone / daylight "
    odd = task.with_examples([replace(task.examples[0], text=text + "saving bug\x85")])  # single-quoted, folded
    write_task_file(odd, tmp_path / "task.yaml")
    assert load_task_file(tmp_path / "task.yaml") == odd


def test_load_labelled_jsonl_csv_split_and_label_map(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"text": "pay bill", "label": "pay_bill", "split": "train"},
                {"text": "hi there", "label": "greeting", "split": "test"},
                {"text": "   ", "label": "greeting", "split": "test"},
                {"text": "who knows", "label": "oos", "split": "test"},
            ]
        )
    )
    mp = tmp_path / "map.json"
    mp.write_text(json.dumps({"banking": ["pay_bill"], "small_talk": ["greeting"]}))
    rows = data.load_labelled(p, label_map=data.load_label_map(mp))
    assert [(r.text, r.label) for r in rows] == [
        ("pay bill", "banking"),
        ("hi there", "small_talk"),
        ("who knows", "oos"),
    ]
    assert [r.label for r in data.resolve(str(p), mp, split="test").rows] == ["small_talk", "oos"]
    c = tmp_path / "t.csv"
    c.write_text('text,label\n"Refund, please",billing\nbroken app,technical\n')
    assert data.load_labelled(c) == [
        data.Labelled("Refund, please", "billing"),
        data.Labelled("broken app", "technical"),
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("text,category\nx,y\n")
    with pytest.raises(data.DataError, match="label"):
        data.load_labelled(bad)
    assert data.descriptions_from_label_map(mp)["banking"] == "e.g. pay bill"


def test_load_labelled_refuses_text_that_is_not_a_string(tmp_path):
    """``"text": null`` (or a number) is a broken row, named with its file and line: not the ticket text "None";
    blank text is skipped as before."""
    p = tmp_path / "t.jsonl"
    rows = [{"text": "pay bill", "label": "billing"}, {"text": " ", "label": "other"}, {"text": None, "label": "other"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(data.DataError, match=r"t\.jsonl:3: 'text' must be a string, got null"):
        data.load_labelled(p)
    p.write_text("\n".join(json.dumps(r) for r in [*rows[:2], {"text": 42, "label": "other"}]) + "\n")
    with pytest.raises(data.DataError, match=r"t\.jsonl:3: 'text' must be a string, got int"):
        data.resolve(str(p))
    c = tmp_path / "t.csv"  # a CSV row cut short has no text at all (csv gives None), not the text "None"
    c.write_text("label,text\nbilling,pay bill\nother\n")
    with pytest.raises(data.DataError, match=r"t\.csv:3: 'text' must be a string, got null"):
        data.load_labelled(c)
    p.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    assert data.load_labelled(p) == [data.Labelled("pay bill", "billing")]


def test_subsample_is_seeded_and_keeps_file_order():
    rows = [data.Labelled(str(i), "a") for i in range(100)]
    s = data.subsample(rows, 10, seed=1)
    assert s == data.subsample(rows, 10, seed=1) and len(s) == 10
    assert [int(r.text) for r in s] == sorted(int(r.text) for r in s)
    assert data.subsample(rows, None) == rows


def test_shipped_support_tickets_are_balanced_and_split():
    from pathlib import Path

    path = Path(__file__).parents[1] / "data" / "support_tickets_labelled.jsonl"
    train, test = data.load_labelled(path, split="train"), data.load_labelled(path, split="test")
    assert {r.label for r in train} == {r.label for r in test} == set(default_task().labels)
    assert len(train) >= 50 and len(test) >= 50
    assert not {r.text for r in train} & {r.text for r in test}


def test_decide_writes_the_fallback_below_the_threshold_and_pick_threshold_uses_dev_rows():
    from worker.engine.results import decide

    probs = np.array([[0.9, 0.05, 0.05], [0.4, 0.35, 0.25], [0.2, 0.5, 0.3]])
    assert decide(probs, LABELS, 0.0, "c") == ["a", "a", "b"]
    assert decide(probs, LABELS, 0.45, "c") == ["a", "c", "b"]  # the fallback may be one of the labels (oos)
    # a threshold only helps when the uncertain rows really are the fallback label; ties go to the lowest
    t, acc = metrics.pick_threshold(probs, LABELS, ["a", "c", "b"], "c", grid=[0.0, 0.3, 0.45, 0.5, 0.9])
    assert (t, acc) == (0.45, 1.0)
    t, acc = metrics.pick_threshold(probs, LABELS, ["a", "a", "b"], "c", grid=[0.0, 0.45])
    assert (t, acc) == (0.0, 1.0)


def test_resolve_keeps_fine_rows_and_groups_beside_the_mapped_rows(tmp_path):
    rows = tmp_path / "d.jsonl"
    rows.write_text(
        "\n".join(json.dumps({"text": t, "label": lab}) for t, lab in [("x", "refund"), ("y", "crash"), ("z", "oos")])
    )
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"billing": ["refund", "invoice"], "technical": ["crash"]}))
    src = data.resolve(str(rows), mapping)
    assert [r.label for r in src.rows] == ["billing", "technical", "oos"]
    assert [r.label for r in src.fine_rows] == ["refund", "crash", "oos"]
    assert src.groups() == {"refund": "billing", "crash": "technical", "oos": "oos"}  # unused fine labels left out
    plain = data.resolve(str(rows))
    assert plain.rows == plain.fine_rows and plain.groups() == {"refund": "refund", "crash": "crash", "oos": "oos"}


def test_a_predicted_label_without_true_rows_counts_in_macro_f1():
    """Its F1 is 0 (every prediction of it is wrong): leaving it out inflated macro-F1 on samples missing a label
    (sklearn's macro average over the labels present in truth or prediction gives the same 5/9)."""
    rep = metrics.evaluate(["a", "a", "b", "b"], ["a", "a", "b", "c"], LABELS)
    assert rep.macro_f1 == pytest.approx((1.0 + 2 / 3 + 0.0) / 3)
