"""Classification metrics in pure numpy: accuracy, macro-F1, per-label P/R, confusion, ECE.

No sklearn: the worker's dependency set stays small, and these are a few lines each.
Predictions outside ``labels`` (e.g. the fallback label) count as wrong for every
metric and are tallied in the confusion matrix's extra last column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.engine.results import decide  # the worker's own rule: a threshold picked here is the one it applies


@dataclass
class Report:
    labels: list[str]
    n: int
    accuracy: float
    macro_f1: float
    precision: dict[str, float]
    recall: dict[str, float]
    f1: dict[str, float]
    support: dict[str, int]
    confusion: list[list[int]]  # rows: true label; columns: predicted label, then "other/fallback"
    ece: float | None = None

    def to_dict(self) -> dict:
        return {
            "n": self.n,
            "accuracy": round(self.accuracy, 4),
            "macro_f1": round(self.macro_f1, 4),
            "ece": None if self.ece is None else round(self.ece, 4),
            "per_label": {
                lab: {
                    "precision": round(self.precision[lab], 4),
                    "recall": round(self.recall[lab], 4),
                    "f1": round(self.f1[lab], 4),
                    "support": self.support[lab],
                }
                for lab in self.labels
            },
            "labels": self.labels,
            "confusion": self.confusion,
        }


def confusion_matrix(y_true: Sequence[str], y_pred: Sequence[str], labels: Sequence[str]) -> np.ndarray:
    """[J, J+1] counts; the last column counts predictions that are not one of ``labels``."""
    index = {lab: i for i, lab in enumerate(labels)}
    cm = np.zeros((len(labels), len(labels) + 1), dtype=np.int64)
    for t, p in zip(y_true, y_pred, strict=True):
        if t not in index:
            raise ValueError(f"true label {t!r} is not one of {list(labels)}")
        cm[index[t], index.get(p, len(labels))] += 1
    return cm


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float64), where=b > 0)


def evaluate(
    y_true: Sequence[str], y_pred: Sequence[str], labels: Sequence[str], confidences: Sequence[float] | None = None
) -> Report:
    """All metrics at once. Labels with no true and no predicted items get P=R=F1=0 but are
    left out of the macro average; a label predicted but never true counts there with F1 0."""
    labels = list(labels)
    cm = confusion_matrix(y_true, y_pred, labels)
    tp = np.diag(cm[:, : len(labels)]).astype(np.float64)
    support = cm.sum(axis=1).astype(np.float64)
    predicted = cm[:, : len(labels)].sum(axis=0).astype(np.float64)
    precision = _div(tp, predicted)
    recall = _div(tp, support)
    f1 = _div(2 * precision * recall, precision + recall)
    n = int(cm.sum())
    has = (support > 0) | (predicted > 0)
    ece = None
    if confidences is not None:
        correct = np.array([t == p for t, p in zip(y_true, y_pred)], dtype=np.float64)
        ece = expected_calibration_error(np.asarray(confidences, dtype=np.float64), correct)
    return Report(
        labels=labels,
        n=n,
        accuracy=float(tp.sum() / n) if n else 0.0,
        macro_f1=float(f1[has].mean()) if has.any() else 0.0,
        precision=dict(zip(labels, precision.tolist())),
        recall=dict(zip(labels, recall.tolist())),
        f1=dict(zip(labels, f1.tolist())),
        support=dict(zip(labels, support.astype(int).tolist())),
        confusion=cm.tolist(),
        ece=ece,
    )


def evaluate_probs(y_true: Sequence[str], probs: np.ndarray, labels: Sequence[str]) -> Report:
    """``evaluate`` of a probability matrix [N, J] over ``labels``: the top label is the prediction,
    its probability the confidence."""
    probs = np.asarray(probs)
    return evaluate(y_true, [labels[k] for k in probs.argmax(1)], labels, probs.max(1))


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = 10) -> float:
    """ECE: |accuracy - mean confidence| per equal-width confidence bin, weighted by bin size.

    0 means "a 0.8 score is right 80% of the time"; the top-label probability is the confidence.
    """
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    if confidence.size == 0:
        return 0.0
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        m = which == b
        if m.any():
            total += m.sum() * abs(correct[m].mean() - confidence[m].mean())
    return float(total / confidence.size)


def selective_accuracy(confidence: Sequence[float], correct: Sequence[bool], thresholds: Sequence[float]) -> list[dict]:
    """For each confidence threshold: the share of items kept (coverage) and accuracy on them.

    What an integrator needs to pick ``TRIAGE_CONFIDENCE_THRESHOLD``: items below it become the fallback label.
    """
    conf = np.asarray(confidence, dtype=np.float64)
    ok = np.asarray(correct, dtype=bool)
    out = []
    for t in thresholds:
        keep = conf >= t
        out.append(
            {
                "threshold": float(t),
                "coverage": round(float(keep.mean()) if conf.size else 0.0, 4),
                "accuracy": round(float(ok[keep].mean()), 4) if keep.any() else None,
            }
        )
    return out


def pick_threshold(
    probs: np.ndarray, labels: Sequence[str], gold: Sequence[str], fallback: str, grid: Sequence[float] | None = None
) -> tuple[float, float]:
    """The ``TRIAGE_CONFIDENCE_THRESHOLD`` with the best accuracy on development rows when ``fallback`` is one of
    the labels (CLINC150's ``oos``: a query no label fits), and that accuracy; ties go to the lowest threshold.

    Pick on development rows, report on test rows: the best threshold on the test rows would flatter the figure.
    """
    grid = np.round(np.arange(0.0, 0.951, 0.05), 2) if grid is None else grid
    best = (-1.0, 0.0)
    for t in grid:
        acc = float(np.mean([p == g for p, g in zip(decide(probs, labels, float(t), fallback), gold)]))
        if acc > best[0]:
            best = (acc, float(t))
    return best[1], best[0]
