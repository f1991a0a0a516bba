"""Optional scoring features switched on by settings (trained head, calibration).

Kept apart from the classifier so the core engine has no knowledge of them:
``Classifier.from_settings`` calls ``apply_scoring_settings`` last.

* ``TRIAGE_SCORER=prompt``: label-token scoring (the engine's ``PromptScorer``).
* ``TRIAGE_SCORER=head``: the head in ``TRIAGE_HEAD_PATH`` (required); it must have been
  fitted for this model, prompt and label set, else start-up fails with the reason.
* ``TRIAGE_SCORER=auto`` (default): the head in ``TRIAGE_HEAD_PATH`` when set; else, when the
  task has at least one few-shot example for every label (the built-in default task does),
  a nearest-centroid head fitted at start-up on those examples' hidden states (one forward
  pass over a handful of examples, well under a second); else prompt scoring. Measured
  on real tickets this beats label-token prompting by a wide margin (docs/quality.md).
* ``TRIAGE_CALIBRATION=contextual``: prompt scores are divided by the model's label
  preference on content-free tickets (one tiny forward pass at start-up). A head's
  probabilities are already fitted to data, so it is left alone (logged).
"""

from __future__ import annotations

import logging
from pathlib import Path

from worker.quality.head import HeadScorer

log = logging.getLogger("triage.quality")

# Head fitted at start-up from task examples (a few per label): the centroid needs no
# regularisation choice and its probabilities were the best calibrated at 1-2 examples per label.
AUTO_METHOD, AUTO_POOLING = "centroid", "mean"


class ScoringConfigError(ValueError):
    pass


def planned_scorer(settings, task, kind: str, model_name: str) -> str:
    """``head`` or ``prompt``: what ``apply_scoring_settings`` will install (the prompt a head reads depends on it)."""
    scorer = getattr(settings, "scorer", "prompt")
    if scorer == "prompt":
        return "prompt"
    if scorer == "head" or getattr(settings, "head_path", None) is not None or kind != "decoder" or "+" in model_name:
        return "head"
    if shipped_head_for(model_name, task) is not None:
        return "head"
    return "head" if not set(task.labels) - {e.label for e in task.examples} else "prompt"


def shipped_head_for(model_name: str, task):
    """The head shipped in the package for this model and the built-in support task, if any."""
    from worker.engine.task import default_task
    from worker.heads import shipped_head_path

    if task.labels != default_task().labels or task.instructions != default_task().instructions:
        return None
    return shipped_head_path(model_name)


def apply_scoring_settings(clf, settings) -> None:
    scorer = getattr(settings, "scorer", "prompt")
    head_path = getattr(settings, "head_path", None)
    needs_head = clf.kind != "decoder" or clf.encoder is not None
    if scorer == "head" and head_path is None:
        raise ScoringConfigError("TRIAGE_SCORER=head needs TRIAGE_HEAD_PATH (a head fitted by `triage-worker fit`)")
    if scorer == "prompt" and needs_head:
        raise ScoringConfigError(f"TRIAGE_SCORER=prompt needs a causal LM's label tokens; {clf.model_name} has none "
                                 "(use TRIAGE_SCORER=auto or head with a head fitted by `triage-worker fit`)")
    shipped = shipped_head_for(clf.model_name, clf.task) if scorer == "auto" and head_path is None else None
    if shipped is not None and not _try_shipped(clf, shipped):
        shipped = None
    if scorer in ("head", "auto") and head_path is not None:
        use_head(clf, head_path)
    elif shipped is not None:
        pass
    elif scorer == "auto":
        missing = sorted(set(clf.labels) - {e.label for e in clf.task.examples})
        if missing and needs_head:
            raise ScoringConfigError(f"{clf.model_name} needs a head: set TRIAGE_HEAD_PATH (`triage-worker fit`) or give "
                                     f"the task an example for every label (none for {missing})")
        if missing:
            log.info("scorer: prompt (no task examples for %s; a head needs one per label)", missing)
        else:
            head = fit_head_on_task_examples(clf)
            clf.scorer = HeadScorer(head, device=clf.device)
            log.info("scorer: %s/%s head fitted on the task's %d examples (TRIAGE_SCORER=prompt for label-token scoring)",
                     head.method, head.pooling, len(clf.task.examples))
    elif scorer == "prompt" and head_path is not None:
        log.warning("TRIAGE_HEAD_PATH is set but TRIAGE_SCORER=prompt: the head is not used")
    if getattr(settings, "calibration", "none") == "contextual":
        if scorer_kind(clf) == "head":
            log.warning("TRIAGE_CALIBRATION=contextual applies to prompt scoring only; the head is used as fitted")
        else:
            from worker.quality.calibration import calibrate_contextual

            bias = calibrate_contextual(clf)
            log.info("contextual calibration: score_bias %s", dict(zip(clf.labels, [round(float(b), 3) for b in bias])))


def fit_head_on_task_examples(clf, method: str = AUTO_METHOD, pooling: str = AUTO_POOLING):
    """A head from the task's own few-shot examples, through the classifier's own forward pass."""
    from worker.quality.features import run_pass
    from worker.quality.head import fit_head, prompt_hash

    examples = clf.task.examples
    feats = run_pass(clf, clf.prepare_valid([e.text for e in examples]), score=False, progress=False)
    meta = {"model": clf.model_name, "prompt_hash": prompt_hash(clf), "dtype": clf.dtype_name, "source": "task examples"}
    return fit_head(feats.pooled(pooling), [e.label for e in examples], clf.labels, method=method, pooling=pooling, meta=meta)


def use_head(clf, path) -> None:
    """Load, check and install a fitted head as ``clf.scorer``."""
    from worker.quality.head import Head

    try:
        head = Head.load(path)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for corrupt files
        raise ScoringConfigError(f"cannot load scorer head {path}: {e}") from e
    head.check(clf)  # HeadMismatch (a ValueError) says what differs
    clf.scorer = HeadScorer(head.reordered(clf.labels), device=clf.device)
    log.info("scorer head loaded: %s (%s, %s pooling, %s training tickets)", path, head.method, head.pooling, head.meta.get("n_train"))


def _try_shipped(clf, path) -> bool:
    """Install the packaged default head when it fits this classifier (model, prompt, labels); else say why not."""
    from worker.quality.head import Head, HeadMismatch

    head = Head.load(path)
    try:
        head.check(clf)
    except HeadMismatch as e:
        log.info("shipped default head not used: %s", e)
        return False
    clf.scorer = HeadScorer(head.reordered(clf.labels), device=clf.device)
    log.info("scorer: shipped default head %s (%s/%s, fitted on %s labelled support tickets; docs/quality.md)",
             Path(path).name, head.method, head.pooling, head.meta.get("n_train"))
    return True


def scorer_kind(clf) -> str:
    return "head" if type(clf.scorer).__name__ == "HeadScorer" else "prompt"
