"""The classification task: labels (with one-line descriptions), instructions, few-shot examples.

Comes from the built-in support-ticket default, a label list or a task file (YAML or
JSON); ``worker.assemble.task_from_settings`` picks one from ``TRIAGE_*``.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
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
        folded: dict[str, str] = {}
        for lab in self.labels:
            other = folded.setdefault(lab.strip().casefold(), lab)
            if other != lab:
                raise TaskError(f"labels {other!r} and {lab!r} differ only in case or spaces")
        for ex in self.examples:
            if ex.label not in self.labels:
                raise TaskError(f"example label {ex.label!r} is not one of {list(self.labels)}")

    def with_examples(self, examples: list[Example]) -> Task:
        return Task(self.labels, self.descriptions, tuple(examples), self.instructions)

    def without_examples(self) -> Task:
        return self.with_examples([])

    def labels_only(self) -> Task:
        """Instructions + label names: the short prompt a head needs (no descriptions, no examples)."""
        return Task(self.labels, {}, (), self.instructions)


def default_task(with_examples: bool = True) -> Task:
    examples = tuple(Example(t, lab) for t, lab in DEFAULT_EXAMPLES) if with_examples else ()
    return Task(tuple(DEFAULT_LABELS), dict(DEFAULT_LABELS), examples)


def task_from_labels(labels: list[str]) -> Task:
    return Task(tuple(labels), {lab: DEFAULT_LABELS[lab] for lab in labels if lab in DEFAULT_LABELS})


TASK_KEYS = ("instructions", "labels", "examples")
LABEL_KEYS = ("name", "description")
EXAMPLE_KEYS = ("text", "label")


def load_task_file(path: Path) -> Task:
    """YAML or JSON (documented in docs/worker.md, "Task file")::

        instructions: "..."            # optional
        labels:                        # list of names, or of {name, description}, or a {name: description} map
          - {name: billing, description: "charges and refunds"}
        examples:                      # optional few-shot examples
          - {text: "I was charged twice", label: billing}

    Strict: an unknown or misspelt key, a missing ``text``/``label``/``name`` is a TaskError
    naming ``file:line`` (YAML) or the file and the item, never a bare KeyError.
    """
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"{path}: cannot read the task file ({e})") from None
    data, lines = _parse_task_text(raw, path)
    where = _Where(path, lines)
    if not isinstance(data, dict) or "labels" not in data:
        raise TaskError(f"{where()}: expected a mapping with a 'labels' key")
    _no_unknown_keys(data, TASK_KEYS, "the task file", where, ())
    labels, descriptions = _parse_labels(data["labels"], where)
    examples = []
    spec = data.get("examples") or []
    if not isinstance(spec, list):
        raise TaskError(f"{where(('examples',))}: 'examples' must be a list of {{text, label}}")
    for i, e in enumerate(spec):
        at = ("examples", i)
        if not isinstance(e, dict):
            raise TaskError(f"{where(at)}: example {i + 1} must be a mapping {{text: ..., label: ...}}, got {e!r:.80}")
        _no_unknown_keys(e, EXAMPLE_KEYS, f"example {i + 1}", where, at)
        for key in EXAMPLE_KEYS:
            if key not in e or e[key] is None or not str(e[key]).strip():
                raise TaskError(f"{where(at)}: example {i + 1} has no '{key}'")
        examples.append(Example(_text(e["text"], where((*at, "text"))), _text(e["label"], where(at)).strip()))
    instructions = _text(data.get("instructions") or DEFAULT_INSTRUCTIONS, where(("instructions",)))
    try:
        return Task(tuple(labels), descriptions, tuple(examples), instructions)
    except TaskError as e:
        raise TaskError(f"{path}: {e}") from None


def _parse_task_text(raw: str, path: Path):
    """The parsed document and, for YAML, a map from key paths to 1-based line numbers."""
    if path.suffix == ".json":
        try:
            return json.loads(raw, object_pairs_hook=_json_object), {}
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
        except _DuplicateKey as e:
            raise TaskError(f"{path}: the key {e.args[0]!r} appears twice in one mapping") from None
    try:
        node = yaml.compose(raw, Loader=_TextLoader)
        data = _load_text_yaml(raw)
    except _DuplicateKey as e:
        key, line = e.args
        raise TaskError(f"{path}:{line}: the key {key!r} appears twice in one mapping") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise TaskError(f"{at}: not valid YAML: {problem}") from None
    lines: dict[tuple, int] = {}
    _index_lines(node, (), lines)
    return data, lines


class _DuplicateKey(ValueError):
    pass


class _TextLoader(yaml.SafeLoader):
    """Every value of a task file is text: ``yes``, ``no``, ``on``, ``1.0``, ``2024-01-01`` stay what was
    written (YAML 1.1 would make a label ``yes`` the boolean True, named "True", and merge ``1.0`` into it);
    ``~``, ``null`` and an empty value still mean nothing, and ``<<`` still merges. A key given twice in one
    mapping is an error, not a silent overwrite."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == MERGE:  # what a merge brings in may be overridden by the mapping's own keys
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # the base class's own error: a one-line "not valid YAML"
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "found unhashable key", key_node.start_mark
                )
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


MERGE, NULL = "tag:yaml.org,2002:merge", "tag:yaml.org,2002:null"
_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag in (NULL, MERGE)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _load_text_yaml(raw: str):
    """One document through ``_TextLoader`` (what ``yaml.load`` does, without a call a scanner must trust)."""
    loader = _TextLoader(raw)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _json_object(pairs: list) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _text(value: object, where: str) -> str:
    """A value that must be text (JSON: a string; a number or a boolean there is a mistake, not a name)."""
    if not isinstance(value, str):
        raise TaskError(f"{where}: expected text, got {json.dumps(value)[:80]}")
    return value


def _index_lines(node, at: tuple, lines: dict) -> None:
    if node is None:
        return
    lines.setdefault(at, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = (*at, k.value)
            lines[key] = k.start_mark.line + 1
            _index_lines(v, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _index_lines(v, (*at, i), lines)


class _Where:
    """``file:line`` of a key path (YAML), or ``file`` plus the path (JSON)."""

    def __init__(self, path: Path, lines: dict):
        self.path, self.lines = path, lines

    def __call__(self, at: tuple = ()) -> str:
        for n in range(len(at), -1, -1):
            if at[:n] in self.lines:
                return f"{self.path}:{self.lines[at[:n]]}"
        return str(self.path)


def _no_unknown_keys(mapping: dict, allowed: tuple[str, ...], what: str, where: _Where, at: tuple) -> None:
    import difflib

    for key in mapping:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (allowed: {', '.join(allowed)})"
            raise TaskError(f"{where((*at, key))}: unknown key '{key}' in {what}{hint}")


def _parse_labels(spec: object, where: _Where) -> tuple[list[str], dict[str, str]]:
    """Names stripped of surrounding spaces (as ``TRIAGE_LABELS``); descriptions as written."""
    if isinstance(spec, dict):
        names, desc = [], {}
        for k, v in spec.items():
            at = where(("labels", k))
            name = _text(k, at).strip()
            names.append(name)
            if v:
                desc[name] = _text(v, at)
        return names, desc
    if isinstance(spec, list):
        names, desc = [], {}
        for i, item in enumerate(spec):
            at = ("labels", i)
            if isinstance(item, str):
                names.append(item.strip())
            elif isinstance(item, dict):
                _no_unknown_keys(item, LABEL_KEYS, f"label {i + 1}", where, at)
                if not str(item.get("name") or "").strip():
                    raise TaskError(f"{where(at)}: label {i + 1} has no 'name'")
                name = _text(item["name"], where(at)).strip()
                names.append(name)
                if item.get("description"):
                    desc[name] = _text(item["description"], where(at))
            else:
                raise TaskError(f"{where(at)}: bad label entry {item!r:.80} (a name, or {{name, description}})")
        return names, desc
    raise TaskError(f"{where(('labels',))}: 'labels' must be a list or a mapping")
