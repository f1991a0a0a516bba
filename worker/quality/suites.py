"""The labelled sets the quality table is measured on: which rows train, which develop, which report.

Fixed here (seeded samples, stated sizes) so every figure in docs/quality.md comes from the same
rows, and re-runs hit the feature cache. Test rows are only for the reported table; choices
(head prompt, feature normalisation) are made on the ``dev`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.engine.task import DEFAULT_INSTRUCTIONS, DEFAULT_LABELS, Task, default_task
from worker.quality import data
from worker.quality.data import Labelled
from worker.quality.fewshot import pick_examples

ROOT = Path(__file__).resolve().parents[2]
FIRST = "tests/data/support_tickets_labelled.jsonl"  # 50 train / 60 test
WRITTEN = "tests/data/support_tickets_written.jsonl"  # 212 train / 104 test (never fitted on)
SUPPORT_FIRST, SUPPORT_WRITTEN = ROOT / FIRST, ROOT / WRITTEN
HEAD_PROMPTS = ("labels", "task")


@dataclass
class Suite:
    name: str
    labels: tuple[str, ...]
    train: list[Labelled]
    dev: list[Labelled]  # for choices; support: empty (choices there use cross-validation on train)
    tests: dict[str, list[Labelled]]  # reporting sets
    task: Task  # the full task prompt (descriptions + one example per label)
    notes: list[str] = field(default_factory=list)
    more_train: list[Labelled] = field(default_factory=list)  # the "more labelled data" lever (encoder row only)

    def prompt_task(self, head_prompt: str) -> Task:
        """``labels``: instructions + label names only; ``task``: the full task prompt."""
        if head_prompt == "labels":
            return self.task.labels_only()
        if head_prompt == "task":
            return self.task
        raise ValueError(f"unknown head prompt {head_prompt!r} (labels or task)")


def support() -> Suite:
    first_train = data.load_labelled(SUPPORT_FIRST, split="train")
    written_train = data.load_labelled(SUPPORT_WRITTEN, split="train")
    return Suite(
        "support",
        tuple(DEFAULT_LABELS),
        first_train + written_train,
        [],
        {
            "support-60": data.load_labelled(SUPPORT_FIRST, split="test"),
            "support-written-104": data.load_labelled(SUPPORT_WRITTEN, split="test"),
        },
        default_task(),
        ["train = the 50 first-set + 212 written training tickets; the built-in task prompt"],
    )


def _disjoint_per_label(rows: list[Labelled], taken: list[Labelled], n: int, seed: int) -> list[Labelled]:
    used = {(r.text, r.label) for r in taken}
    rest = [r for r in rows if (r.text, r.label) not in used]
    return [Labelled(e.text, e.label) for e in pick_examples(rest, n, seed + 1, max_chars=None)]


def clinc_domains() -> Suite:
    src = data.resolve("clinc150-domains:train")
    train = [Labelled(e.text, e.label) for e in pick_examples(src.rows, 100, 0, max_chars=None)]
    dev = data.subsample(data.resolve("clinc150-domains:val").rows, 330, 0)
    test = data.subsample(data.resolve("clinc150-domains:test").rows, 400, 0)
    labels = tuple(data.label_order(test, train, preferred=list(DEFAULT_LABELS)))
    desc = {k: v for k, v in data.descriptions_from_label_map(src.label_map_path).items() if k in labels}
    task = Task(labels, desc, tuple(pick_examples(train, 1, 0, labels)), DEFAULT_INSTRUCTIONS)
    return Suite(
        "clinc150-domains",
        labels,
        train,
        dev,
        {"clinc150-domains-400": test},
        task,
        ["train 100 per label (1,100); dev: 330 sampled validation queries; test: 400 of 5,500 (seed 0)"],
    )


def banking77() -> Suite:
    rows = data.resolve("banking77:train").rows
    train = [Labelled(e.text, e.label) for e in pick_examples(rows, 20, 0, max_chars=None)]
    dev = _disjoint_per_label(rows, train, 5, 0)
    test = data.subsample(data.resolve("banking77:test").rows, 500, 0)
    labels = tuple(data.label_order(test, train))
    task = Task(labels, {}, tuple(pick_examples(train, 1, 0, labels)), DEFAULT_INSTRUCTIONS)
    more = [Labelled(e.text, e.label) for e in pick_examples(rows, 60, 0, max_chars=None)]
    return Suite(
        "banking77",
        labels,
        train,
        dev,
        {"banking77-500": test},
        task,
        ["train 20 per label (1,540); dev: 5 more per label from train (385); test: 500 of 3,080 (seed 0)"],
        more_train=more,
    )


SUITES = {"support": support, "clinc150-domains": clinc_domains, "banking77": banking77}


def load(name: str) -> Suite:
    return SUITES[name]()
