"""Contextual / prior correction of label scores (a ``score_bias`` for the classifier's constructor).

Small prompted models prefer some label names whatever the ticket says. Contextual
calibration (Zhao et al., 2021, "Calibrate Before Use") measures that preference on
content-free tickets ("N/A", an empty ticket, "[ticket]") and divides it out:
``p(label | ticket) / p(label | content-free)``, which is ``log p - log p_cf`` in the
log-scores the engine already subtracts ``score_bias`` from. Prior correction does
the same with the mean prediction over a sample of real (unlabelled) tickets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.engine.classifier import Classifier, softmax
from worker.engine.types import Prepared

CONTENT_FREE = ("N/A", "", "[ticket]")


def content_free_items(clf: Classifier, texts: Sequence[str] = CONTENT_FREE) -> list[Prepared]:
    """Prepared suffixes for the content-free texts; "" becomes just the answer cue (``prepare`` rejects it)."""
    out = []
    for t in texts:
        if t.strip():
            out.extend(clf.prepare_valid([t]))
        else:
            out.append(Prepared(ids=tuple(clf.template.tail_ids), n_text_tokens=0, truncated=False))
    return out


def bias_from_scores(log_scores: np.ndarray, prior: np.ndarray | None = None) -> np.ndarray:
    """``log(mean predicted distribution) - log(prior)``, centred (softmax ignores a constant)."""
    p = softmax(np.asarray(log_scores, dtype=np.float64)).mean(axis=0)
    bias = np.log(np.clip(p, 1e-12, None))
    if prior is not None:
        bias = bias - np.log(np.clip(np.asarray(prior, dtype=np.float64), 1e-12, None))
    return bias - bias.mean()


def contextual_bias(clf: Classifier, texts: Sequence[str] = CONTENT_FREE) -> np.ndarray:
    """One small pass over the content-free tickets (raw scores: any bias of ``clf`` is not applied)."""
    return bias_from_scores(clf.run_pass(content_free_items(clf, texts)))
