"""Which of the methods ``eval`` measured is the one a worker with these settings runs (the report's
``worker_default``): the scorer rule of ``worker.assemble.choose_scorer``, told without loading a model."""

from __future__ import annotations

from pathlib import Path

from worker.assemble import AUTO_METHOD, AUTO_POOLING, shipped_head_for
from worker.engine.task import Task


def worker_default(settings, base: Task, head_file: Path | None) -> dict:
    """What a worker started with these settings would score with (see worker.assemble), as the fields of the
    measured method that is exactly it: ``method`` and, for prompt scoring, ``variant`` and ``calibration``; for a
    head file (``TRIAGE_HEAD_PATH``, the shipped one) its ``head_file``; for the start-up head its ``name``.
    ``evaluate_all`` reports the method that matches all of them, or none (not measured)."""
    prompt = {"method": "prompt", "variant": "task", "calibration": settings.calibration}
    if settings.scorer == "prompt":
        return prompt
    if head_file is not None:
        return {"method": "head", "head_file": str(head_file)}
    if settings.scorer == "auto":
        shipped = shipped_head_for(settings.model + (f"+{settings.encoder}" if settings.encoder else ""), base)
        if shipped is not None:
            return {"method": "head", "head_file": str(shipped)}
    if settings.scorer == "auto" and base.examples and {e.label for e in base.examples} == set(base.labels):
        return {"method": "head", "name": f"head on task examples {AUTO_METHOD}/{AUTO_POOLING}"}
    return prompt


def is_method(m: dict, want: dict) -> bool:
    """``m`` (a report entry) is the method ``want`` (``worker_default``) describes: every field equal, head files
    compared as the files they name."""
    for key, value in want.items():
        if key == "head_file":
            if m.get(key) is None or Path(m[key]).resolve() != Path(value).resolve():
                return False
        elif m.get(key) != value:
            return False
    return True


def describe_method(want: dict) -> str:
    """``worker_default``'s answer in words (the report's ``worker_runs``: said also when it was not measured)."""
    if "head_file" in want:
        return f"head file {want['head_file']}"
    if "name" in want:
        return want["name"]
    return f"prompt '{want['variant']}', calibration {want['calibration']}"
