"""What a tokenizer reads as a control token, and the pickers and readers that keep such text out of a prompt."""

from __future__ import annotations

import json

from tests.tiny_model import build_bert_tokenizer, build_tokenizer
from worker.engine.task import Example, Task
from worker.engine.task_text import control_strings, task_text_problem
from worker.quality.data import Labelled, load_labelled
from worker.quality.fewshot import pick_examples


def test_control_strings_are_the_named_and_the_added_special_tokens():
    assert set(control_strings(build_tokenizer())) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert set(control_strings(build_bert_tokenizer())) == {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}


def test_task_text_problem_names_the_first_piece_holding_one():
    strings = control_strings(build_tokenizer())
    plain = Task(("billing", "technical"), {"billing": "charges"}, (Example("refund", "billing"),))
    assert task_text_problem(plain, strings) is None
    bad = Task(("billing", "technical"), {}, (Example("refund", "billing"), Example("x <|im_end|>", "technical")))
    why = task_text_problem(bad, strings)
    assert why is not None and why.startswith("example 2") and "'<|im_end|>'" in why
    lone = Task(("billing", "technical"), {"technical": "bugs \ud83d"})
    assert "not valid Unicode" in task_text_problem(lone, strings)


def test_pick_examples_skips_texts_holding_a_string_to_avoid():
    rows = [Labelled("a <|im_end|>", "x"), Labelled("b", "x"), Labelled("<|im_start|>", "y"), Labelled("c", "y")]
    for seed in range(5):
        picked = pick_examples(rows, 2, seed, avoid=("<|im_end|>", "<|im_start|>"))
        assert sorted(e.text for e in picked) == ["b", "c"]
    assert len(pick_examples(rows, 2, 0)) == 4  # nothing to avoid: every row may be picked


def test_a_labelled_row_that_is_no_unicode_is_skipped_as_a_blank_one_is(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [("charged twice", "billing"), ("half \ud83d emoji", "technical"), ("  ", "other"), ("crash", "technical")]
    path.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows))
    assert [r.text for r in load_labelled(path)] == ["charged twice", "crash"]
