"""Run the engine on a window so that one bad ticket cannot fail its neighbours.

The whole window goes through ``Classifier.classify`` (length buckets + prefix
cache). If that raises, every ticket is re-run alone: the ones that pass get
their label, the ones that still fail come back as the exception (the caller
dead-letters them with it as the reason).
"""

from __future__ import annotations

from typing import Callable, Sequence

from worker.engine.types import Prediction, Prepared, RunStats

ClassifyFn = Callable[[Sequence[Prepared]], tuple[list[Prediction], RunStats]]


def classify_isolated(classify: ClassifyFn, items: Sequence[Prepared]) -> tuple[list[Prediction | Exception], RunStats, int]:
    """Predictions (or the exception that item raised alone) in input order, merged stats, items re-run alone."""
    if not items:
        return [], RunStats(), 0
    try:
        preds, stats = classify(items)
        return list(preds), stats, 0
    except Exception as batch_error:  # noqa: BLE001 - isolated below
        if len(items) == 1:
            return [batch_error], RunStats(items=1), 0
    out: list[Prediction | Exception] = []
    total = RunStats(items=len(items))
    for item in items:
        try:
            preds, stats = classify([item])
        except Exception as e:  # noqa: BLE001 - this item's own failure
            out.append(e)
            continue
        out.append(preds[0])
        total.merge(stats)
    return out, total, len(items)
