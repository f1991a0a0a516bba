"""The classification task: labels (with one-line descriptions), instructions, few-shot examples.

Comes from the built-in support-ticket default, a label list or a task file (YAML or
JSON); ``worker.assemble.task_from_settings`` picks one from ``TRIAGE_*``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEFAULT_INSTRUCTIONS = (
    "You are a customer-support triage assistant. Read the customer's ticket and "
    "answer with exactly one category name from the list, nothing else."
)

DEFAULT_LABELS: dict[str, str] = {
    "billing": "charges, refunds, invoices, payments, subscriptions and pricing",
    "technical": "bugs, errors, crashes, outages, things not working, setup problems",
    "account": "login, password, sign-up, profile, access, account closure or security",
    "shipping": "delivery, tracking, lost or late packages, addresses, returns in transit",
    "other": "anything else: feedback, general questions, sales, partnerships",
}

DEFAULT_EXAMPLES: list[tuple[str, str]] = [
    ("I was charged twice for my subscription this month, please refund one payment.", "billing"),
    ("The app crashes every time I open the settings page on Android.", "technical"),
    ("I can't log in, the password reset email never arrives.", "account"),
    ("My package has shown 'in transit' for ten days, where is it?", "shipping"),
    ("Do you offer discounts for non-profit organisations?", "other"),
]


class TaskError(ValueError):
    pass


@dataclass(frozen=True)
class Example:
    text: str
    label: str


@dataclass(frozen=True)
class Task:
    labels: tuple[str, ...]
    descriptions: dict[str, str] = field(default_factory=dict)
    examples: tuple[Example, ...] = ()
    instructions: str = DEFAULT_INSTRUCTIONS

    def __post_init__(self) -> None:
        if len(self.labels) < 2:
            raise TaskError("a task needs at least two labels")
        if len(set(self.labels)) != len(self.labels):
            raise TaskError(f"duplicate labels: {list(self.labels)}")
        if any(not lab.strip() for lab in self.labels):
            raise TaskError("labels must be non-empty")
        for ex in self.examples:
            if ex.label not in self.labels:
                raise TaskError(f"example label {ex.label!r} is not one of {list(self.labels)}")

    def with_examples(self, examples: list[Example]) -> "Task":
        return Task(self.labels, self.descriptions, tuple(examples), self.instructions)

    def without_examples(self) -> "Task":
        return self.with_examples([])


def default_task(with_examples: bool = True) -> Task:
    examples = tuple(Example(t, lab) for t, lab in DEFAULT_EXAMPLES) if with_examples else ()
    return Task(tuple(DEFAULT_LABELS), dict(DEFAULT_LABELS), examples)


def task_from_labels(labels: list[str]) -> Task:
    return Task(tuple(labels), {lab: DEFAULT_LABELS[lab] for lab in labels if lab in DEFAULT_LABELS})


def load_task_file(path: Path) -> Task:
    """YAML or JSON::

        instructions: "..."            # optional
        labels:                        # list of names, or of {name, description}, or a {name: description} map
          - {name: billing, description: "charges and refunds"}
        examples:                      # optional few-shot examples
          - {text: "I was charged twice", label: billing}
    """
    raw = Path(path).read_text(encoding="utf-8")
    data = json.loads(raw) if Path(path).suffix == ".json" else yaml.safe_load(raw)
    if not isinstance(data, dict) or "labels" not in data:
        raise TaskError(f"{path}: expected a mapping with a 'labels' key")
    labels, descriptions = _parse_labels(data["labels"], path)
    examples = tuple(Example(str(e["text"]), str(e["label"])) for e in data.get("examples") or [])
    instructions = str(data.get("instructions") or DEFAULT_INSTRUCTIONS)
    return Task(tuple(labels), descriptions, examples, instructions)


def _parse_labels(spec: object, path: Path) -> tuple[list[str], dict[str, str]]:
    if isinstance(spec, dict):
        return [str(k) for k in spec], {str(k): str(v) for k, v in spec.items() if v}
    if isinstance(spec, list):
        names, desc = [], {}
        for item in spec:
            if isinstance(item, str):
                names.append(item)
            elif isinstance(item, dict) and "name" in item:
                names.append(str(item["name"]))
                if item.get("description"):
                    desc[str(item["name"])] = str(item["description"])
            else:
                raise TaskError(f"{path}: bad label entry {item!r}")
        return names, desc
    raise TaskError(f"{path}: 'labels' must be a list or a mapping")

