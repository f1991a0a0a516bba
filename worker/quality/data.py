"""Labelled data: JSON Lines / CSV files with ``text`` and ``label``, and the public sets we measure on.

A file may carry a ``split`` column (train/test); a label map folds fine labels into
coarse ones (CLINC150's 150 intents -> its 10 domains, ``oos`` kept as its own label).
Named sets: ``clinc150-domains:<split>``, ``clinc150:<split>`` and ``banking77:<split>``
resolve under a data directory (default ``../shared/data`` beside the checkout, or ``TRIAGE_DATA_DIR``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.engine.types import unicode_problem
from worker.ticket_files import read_numbered

log = logging.getLogger("triage.quality")

# The datasets sit in ../shared/data next to the repository checkout.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Labelled:
    text: str
    label: str


def data_dir() -> Path:
    return Path(os.environ.get("TRIAGE_DATA_DIR") or DEFAULT_DATA_DIR)


def load_label_map(path: str | Path) -> dict[str, str]:
    """``{coarse: [fine, ...]}`` (the shape of CLINC150's domains.json) -> ``{fine: coarse}``."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a mapping of coarse label -> list of fine labels")
    inverse: dict[str, str] = {}
    for coarse, fines in raw.items():
        for fine in [fines] if isinstance(fines, str) else fines:
            if fine in inverse and inverse[fine] != coarse:
                raise DataError(f"{path}: {fine!r} maps to both {inverse[fine]!r} and {coarse!r}")
            inverse[str(fine)] = str(coarse)
    return inverse


def load_labelled(
    path: str | Path,
    *,
    label_field: str = "label",
    label_map: dict[str, str] | None = None,
    split: str | None = None,
) -> list[Labelled]:
    """Rows with non-empty text and a label. Unmapped labels pass through (CLINC's ``oos``).

    A row with blank text is skipped (nothing to classify); a row without a label, or whose text is not a string
    (``null``, a number; a CSV row cut short), is a ``DataError`` naming ``file:line``, the line the row starts on as
    an editor shows it (its position among the rows is another number once a JSON Lines file has blank lines or a
    CSV field spans lines): a broken export, not a ticket to drop quietly or to read as the text "None". A text no
    tokenizer takes (a lone surrogate, half an emoji) is skipped with a warning naming ``file:line``, as the worker
    dead-letters that ticket alone.
    """
    out = []
    for line, row in read_numbered(path):
        if split is not None and str(row.get("split", "")) != split:
            continue
        if label_field not in row or row[label_field] in (None, ""):
            raise DataError(f"{path}:{line}: no {label_field!r}")
        label = str(row[label_field])
        label = label_map.get(label, label) if label_map else label
        text = row["text"]
        if not isinstance(text, str):
            got = "null" if text is None else type(text).__name__
            raise DataError(f"{path}:{line}: 'text' must be a string, got {got}")
        if (why := unicode_problem(text)) is not None:
            log.warning("%s:%s: row skipped: %s", path, line, why)
        elif text.strip():
            out.append(Labelled(text, label))
    if not out:
        raise DataError(f"{path}: no labelled rows" + (f" with split={split!r}" if split else ""))
    return out


@dataclass
class Source:
    rows: list[Labelled]
    description: str
    label_map_path: Path | None  # the coarse-label map applied, if any (its fine labels describe the coarse ones)
    fine_rows: list[Labelled] = field(default_factory=list)  # the same rows before the map (== rows without one)
    label_map: dict[str, str] = field(default_factory=dict)  # fine -> coarse, as applied
    path: Path | None = None  # the file the rows came from
    split: str | None = None  # the rows' ``split`` field kept (None: every row of ``path``)

    def groups(self) -> dict[str, str]:
        """Every fine label -> the coarse label it was mapped to (unmapped labels, like ``oos``, to themselves)."""
        return {r.label: self.label_map.get(r.label, r.label) for r in self.fine_rows}


NAMED = {"clinc150-domains": "clinc150", "clinc150": "clinc150", "banking77": "banking77"}  # name -> file stem


def resolve(
    spec: str, label_map_path: str | Path | None = None, split: str | None = None, *, default_split: str = "test"
) -> Source:
    """A file path (``split``: keep only rows whose ``split`` field equals it), or a named set ``NAME[:SPLIT]``.

    A named set's split picks its file (``split`` may name it too); without one it is ``default_split``: ``test``
    for what is measured, ``train`` for what a head is fitted on (``fit``, ``eval --train``), so a training input
    never falls back to the test file unasked."""
    name, _, named_split = spec.partition(":")
    root = data_dir()
    if name in NAMED:
        if named_split and split and named_split != split:
            raise DataError(f"{spec}: two splits asked for ({named_split!r} and {split!r}); name one")
        file_split = named_split or split or default_split
        if name == "clinc150-domains":
            label_map_path = root / "clinc150" / "domains.json"
        path = root / NAMED[name] / f"{NAMED[name]}_{file_split}.jsonl"
        split = None  # the file is the split (its rows have no split field)
    else:
        path = Path(spec)
    if not Path(path).is_file():
        raise DataError(f"no such file: {path}")
    label_map = load_label_map(label_map_path) if label_map_path else {}
    fine = load_labelled(path, split=split)
    rows = [Labelled(r.text, label_map.get(r.label, r.label)) for r in fine] if label_map else fine
    desc = (
        f"{path}" + (f" split={split}" if split else "") + (f" labels mapped by {label_map_path}" if label_map else "")
    )
    return Source(rows, desc, Path(label_map_path) if label_map_path else None, fine, label_map, Path(path), split)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def provenance(source: Source) -> dict:
    """What a head records of the rows it was fitted on, in the shipped heads' shape: the file, its content hash
    and the splits kept (None: every row). ``seen_in_fit`` reads it back."""
    return {
        "file": str(source.path),
        "sha256": sha256_file(source.path),
        "fitted_splits": [source.split] if source.split else None,
    }


def seen_in_fit(fitted: Sequence[dict], source: Source) -> bool:
    """Whether rows of ``source`` may be among those a head was fitted on (``fitted``: its ``provenance`` entries,
    ``meta["data"]``): the same file by content, and a shared split or a whole file on either side. A head scored
    on such rows measures its memory, not its accuracy."""
    sha = sha256_file(source.path)
    for d in fitted:
        splits = d.get("fitted_splits")
        if d.get("sha256") == sha and (splits is None or source.split is None or source.split in splits):
            return True
    return False


def descriptions_from_label_map(path: str | Path, max_items: int = 8) -> dict[str, str]:
    """``{coarse: "e.g. fine one, fine two, ..."}``: a coarse label described by its fine labels."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    return {"oos": "out of scope: the request fits none of the other categories"} | {
        str(k): "e.g. " + ", ".join(str(f).replace("_", " ") for f in ([v] if isinstance(v, str) else v)[:max_items])
        for k, v in raw.items()
    }


def subsample(rows: Sequence[Labelled], n: int | None, seed: int = 0) -> list[Labelled]:
    """A seeded random sample of ``n`` rows (all rows when ``n`` is None or larger), in file order."""
    if n is None or n >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def require_every_label(labels: Sequence[str], rows: Sequence[Labelled], what: str) -> None:
    """``DataError`` unless every one of ``labels`` has a row: a head is fitted on one or more tickets per label
    (``head.fit_head``); said before any model is loaded, in one line."""
    have = {r.label for r in rows}
    missing = [lab for lab in labels if lab not in have]
    if missing:
        raise DataError(
            f"{what} has no tickets for the task's labels {missing[:10]}{' ...' if len(missing) > 10 else ''}: "
            "a head needs at least one per label (add some, or set TRIAGE_LABELS / TRIAGE_TASK_FILE to the labels "
            "the data has)"
        )


def label_order(*row_sets: Sequence[Labelled], preferred: Sequence[str] = ()) -> list[str]:
    """Labels seen in the data: ``preferred`` ones first (in that order), then the rest sorted."""
    seen = {r.label for rows in row_sets for r in rows}
    return [lab for lab in preferred if lab in seen] + sorted(seen - set(preferred))
