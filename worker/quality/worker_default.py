"""Which of the methods ``eval`` measured is the one a worker with these settings runs (the report's
``worker_default``): ``scorer_plan.plan_scorer``, the rule the worker's builder follows, told without a model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from worker.assemble import AUTO_METHOD, AUTO_POOLING
from worker.engine.task import Task
from worker.scorer_plan import ScoringConfigError, plan_scorer


def worker_default(
    settings,
    base: Task,
    head_file: Path | None,
    *,
    needs_head: bool = False,
    fits: Callable[[Path], bool] | None = None,
) -> dict:
    """What a worker started with these settings would score with, as the fields of the measured method that is
    exactly it: ``method`` and, for prompt scoring, ``variant`` and ``calibration``; for a head file
    (``TRIAGE_HEAD_PATH``, the shipped one) its ``head_file``; for the start-up head its ``name``.
    ``evaluate_all`` reports the method that matches all of them, or none (not measured).

    As the builder decides: ``needs_head``, the backbone has no label tokens (an encoder, joined features);
    ``fits(path)``, whether the shipped head fits the worker's head prompt (one that does not falls back, as
    ``assemble.carry_out``). Settings no worker starts with give ``{"method": "none", "unstartable": why}``."""
    prompt = {"method": "prompt", "variant": "task", "calibration": settings.calibration}
    name = settings.model + (f"+{settings.encoder}" if settings.encoder else "")  # assemble's backbone name
    try:
        plan = plan_scorer(settings.scorer, head_file, name, base, needs_head=needs_head)
    except ScoringConfigError as e:
        return {"method": "none", "unstartable": str(e)}
    if plan.kind == "shipped_head" and fits is not None and not fits(plan.path):
        plan = plan.fallback
    if plan.kind == "unscorable":
        return {"method": "none", "unstartable": str(plan.error())}
    if plan.kind in ("head_file", "shipped_head"):
        return {"method": "head", "head_file": str(plan.path)}
    if plan.kind == "task_examples":
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
    if "unstartable" in want:
        return f"nothing: no worker starts with these settings ({want['unstartable']})"
    if "head_file" in want:
        return f"head file {want['head_file']}"
    if "name" in want:
        return want["name"]
    return f"prompt '{want['variant']}', calibration {want['calibration']}"
