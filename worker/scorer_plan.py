"""Which scorer ``TRIAGE_SCORER`` picks: one pure rule, decided without a model.

``assemble.choose_scorer`` carries the plan out on a loaded classifier; ``eval`` names from it the
measured method a worker with these settings runs (``quality/worker_default.py``). One rule, so the
two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.engine.task import Task
from worker.engine.types import ConfigError


class ScoringConfigError(ConfigError):
    """TRIAGE_SCORER / TRIAGE_HEAD_PATH ask for something this model and task cannot do; ``setting`` is the one to
    change (what preflight and the worker's ``config_invalid`` line name)."""

    def __init__(self, setting: str, text: str):
        super().__init__(f"{setting}: {text}", setting=setting)
        self.text = text


@dataclass(frozen=True)
class ScorerPlan:
    """``head_file``: the head at ``path`` (``TRIAGE_HEAD_PATH``), which must fit. ``shipped_head``: the package's head
    at ``path`` when it fits this model and prompt, else ``fallback``. ``task_examples``: a head fitted at start-up on
    the task's few-shot examples. ``prompt``: label-token scoring (``missing_examples``: under ``auto``, the labels no
    example shows). ``unscorable``: no scorer can work (``reason``), only ever a fallback: at the top it is raised."""

    kind: Literal["prompt", "head_file", "shipped_head", "task_examples", "unscorable"]
    path: Path | None = None
    fallback: ScorerPlan | None = None
    missing_examples: tuple[str, ...] = ()
    reason: str = ""

    def error(self) -> ScoringConfigError:
        """An ``unscorable`` plan as the error it raises (it always concerns the missing head file)."""
        return ScoringConfigError("TRIAGE_HEAD_PATH", self.reason)


def labels_without_examples(task: Task) -> list[str]:
    """The task's labels no few-shot example shows (a head fitted on the examples needs one per label)."""
    return sorted(set(task.labels) - {e.label for e in task.examples})


def shipped_head_for(model_name: str, task: Task) -> Path | None:
    """The head the package ships for this model and the built-in support task (labels and instructions), if any."""
    from worker.engine.task import default_task
    from worker.heads import shipped_head_path

    builtin = default_task()
    if task.labels != builtin.labels or task.instructions != builtin.instructions:
        return None
    return shipped_head_path(model_name)


def plan_scorer(
    scorer: str, head_path: Path | None, model_name: str, task: Task, *, needs_head: bool = False, what: str = ""
) -> ScorerPlan:
    """The scorer ``scorer`` (``TRIAGE_SCORER``) asks for; ``needs_head``: the model has no label tokens (an
    encoder, joined features); ``what``: that model in words (default its name). Raises ``ScoringConfigError`` for
    settings no model could start with. ``task`` is read only under ``auto``."""
    what = what or model_name
    if scorer == "head" and head_path is None:
        raise ScoringConfigError(
            "TRIAGE_HEAD_PATH",
            "is not set, but TRIAGE_SCORER=head needs it: a head fitted by `triage-worker fit` (or TRIAGE_SCORER=auto)",
        )
    if scorer == "prompt" and needs_head:
        raise ScoringConfigError(
            "TRIAGE_SCORER",
            f"prompt needs a causal LM's label tokens, which {what} lacks "
            "(use TRIAGE_SCORER=auto or head, with a head fitted by `triage-worker fit`)",
        )
    if scorer in ("head", "auto") and head_path is not None:
        return ScorerPlan("head_file", head_path)
    if scorer != "auto":
        return ScorerPlan("prompt")
    missing = labels_without_examples(task)
    if missing and needs_head:
        fallback = ScorerPlan(
            "unscorable",
            reason=f"is not set, and {what} needs a head: set TRIAGE_HEAD_PATH (`triage-worker fit`) or give the "
            f"task an example for every label (none for {missing})",
        )
    elif missing:
        fallback = ScorerPlan("prompt", missing_examples=tuple(missing))
    else:
        fallback = ScorerPlan("task_examples")
    shipped = shipped_head_for(model_name, task)
    if shipped is not None:
        return ScorerPlan("shipped_head", shipped, fallback=fallback)
    if fallback.kind == "unscorable":
        raise fallback.error()
    return fallback
