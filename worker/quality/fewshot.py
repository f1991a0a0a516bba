"""Pick few-shot examples from a labelled training file and write them into a task file.

Seeded, so a task file can be regenerated exactly. Examples are interleaved
label by label (round-robin, label order shuffled per round) instead of grouped:
small models lean towards whichever label they saw last, so grouping biases them.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import yaml

from worker.engine.task import Example, Task
from worker.quality.data import Labelled


def pick_examples(
    rows: Sequence[Labelled],
    k: int,
    seed: int = 0,
    labels: Sequence[str] | None = None,
    max_chars: int | None = 600,
    avoid: Sequence[str] = (),
) -> list[Example]:
    """Up to ``k`` examples per label (fewer when the data has fewer), interleaved.

    ``max_chars`` skips very long texts when shorter ones exist: every example is
    part of the prompt prefix, paid for in attention on every ticket. A text holding
    one of ``avoid`` (the model's control-token strings, ``engine.task_text``) is
    never picked: in the prompt it would be a control token, and the worker refuses it.
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    rng = random.Random(seed)
    by_label: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if not any(s in r.text for s in avoid):
            by_label[r.label].append(r.text)
    order = list(labels) if labels is not None else sorted(by_label)
    chosen: dict[str, list[str]] = {}
    for lab in order:
        texts = list(dict.fromkeys(by_label.get(lab, [])))  # de-duplicate, keep file order
        short = [t for t in texts if max_chars is None or len(t) <= max_chars]
        pool = short if len(short) >= k else texts
        chosen[lab] = rng.sample(pool, min(k, len(pool)))
    out: list[Example] = []
    for i in range(k):
        round_labels = [lab for lab in order if i < len(chosen[lab])]
        rng.shuffle(round_labels)
        out.extend(Example(chosen[lab][i], lab) for lab in round_labels)
    return out


def for_prompt(rows: Sequence[Labelled] | None, loaded) -> list[Labelled] | None:
    """``rows`` less those a causal LM's prompt cannot hold as few-shot examples (``engine.task_text``)."""
    from worker.engine.task_text import control_strings

    if rows is None or loaded.kind != "decoder":
        return rows
    avoid = control_strings(loaded.tokenizer)
    return [r for r in rows if not any(s in r.text for s in avoid)]


def task_to_dict(task: Task) -> dict:
    """The task-file shape ``worker.engine.task.load_task_file`` reads back."""
    return {
        "instructions": task.instructions,
        "labels": [
            {"name": lab, "description": task.descriptions[lab]} if task.descriptions.get(lab) else {"name": lab}
            for lab in task.labels
        ],
        "examples": [{"text": e.text, "label": e.label} for e in task.examples],
    }


def write_task_file(task: Task, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = task_to_dict(task)
    if path.suffix == ".json":
        import json

        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    else:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)
        if yaml.safe_load(text) != data:  # a raw U+0085 (NEL, cp1252's "..." read as Latin-1) reads back as a line
            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False, width=120)  # break: escaped, exact
        path.write_text(text, encoding="utf-8")
