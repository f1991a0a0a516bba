"""Optional scoring features switched on by settings (trained head, calibration).

Kept apart from the classifier so the core engine has no knowledge of them:
``Classifier.from_settings`` calls ``apply_scoring_settings`` last.

* ``TRIAGE_SCORER=prompt``: label-token scoring (the engine's ``PromptScorer``).
* ``TRIAGE_SCORER=head``: the head in ``TRIAGE_HEAD_PATH`` (required); it must have been
  fitted for this model, prompt and label set, else start-up fails with the reason.
* ``TRIAGE_SCORER=auto`` (default): the head when ``TRIAGE_HEAD_PATH`` is set, else prompt
  scoring. A head is never fitted implicitly at start-up: fitting needs labelled data
  the task file does not hold in useful amounts (see docs/quality.md).
* ``TRIAGE_CALIBRATION=contextual``: prompt scores are divided by the model's label
  preference on content-free tickets (one tiny forward pass at start-up). A head's
  probabilities are already fitted to data, so it is left alone (logged).
"""

from __future__ import annotations

import logging

log = logging.getLogger("triage.quality")


class ScoringConfigError(ValueError):
    pass


def apply_scoring_settings(clf, settings) -> None:
    scorer = getattr(settings, "scorer", "prompt")
    head_path = getattr(settings, "head_path", None)
    if scorer == "head" and head_path is None:
        raise ScoringConfigError("TRIAGE_SCORER=head needs TRIAGE_HEAD_PATH (a head fitted by `triage-worker fit`)")
    if scorer in ("head", "auto") and head_path is not None:
        use_head(clf, head_path)
    elif scorer == "prompt" and head_path is not None:
        log.warning("TRIAGE_HEAD_PATH is set but TRIAGE_SCORER=prompt: the head is not used")
    if getattr(settings, "calibration", "none") == "contextual":
        if scorer_kind(clf) == "head":
            log.warning("TRIAGE_CALIBRATION=contextual applies to prompt scoring only; the head is used as fitted")
        else:
            from worker.quality.calibration import calibrate_contextual

            bias = calibrate_contextual(clf)
            log.info("contextual calibration: score_bias %s", dict(zip(clf.labels, [round(float(b), 3) for b in bias])))


def use_head(clf, path) -> None:
    """Load, check and install a fitted head as ``clf.scorer``."""
    from worker.quality.head import Head, HeadScorer

    try:
        head = Head.load(path)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for corrupt files
        raise ScoringConfigError(f"cannot load scorer head {path}: {e}") from e
    head.check(clf)  # HeadMismatch (a ValueError) says what differs
    clf.scorer = HeadScorer(head.reordered(clf.labels), device=clf.device)
    log.info("scorer head loaded: %s (%s, %s pooling, %s training tickets)", path, head.method, head.pooling, head.meta.get("n_train"))


def scorer_kind(clf) -> str:
    return "head" if type(clf.scorer).__name__ == "HeadScorer" else "prompt"
