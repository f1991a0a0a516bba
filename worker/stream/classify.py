"""Run the engine on a window pass by pass, so that one bad ticket cannot fail its neighbours.

The window's tickets are planned into passes (length buckets, ``Classifier.plan``) and
each pass runs on its own (``Classifier.classify_passes``), so its results can be written
before the next pass runs. If a pass raises, its tickets are re-run alone: the ones that
pass get their label, the ones that still fail come back as the exception (the caller
dead-letters them with it as the reason). Pure: no torch (the classifier is passed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

from worker.engine.bucketing import Pass
from worker.engine.types import PassStats, Prediction, Prepared, RunStats

PassesFn = Callable[[Sequence[Prepared], Sequence[Pass]], Iterable[tuple[tuple[int, ...], list[Prediction], PassStats]]]


@dataclass
class PassResult:
    """One planned pass of a window: its tickets (indices into the window's prepared items),
    a prediction or the exception per ticket, and what the forward calls cost."""

    indices: tuple[int, ...]
    predictions: list[Prediction | Exception]
    stats: RunStats = field(default_factory=RunStats)  # 1 forward call, or one per ticket after a failure
    split_retries: int = 0  # tickets re-run alone because the pass failed


def run_passes(classify_passes: PassesFn, plan: Sequence[Pass], items: Sequence[Prepared]) -> Iterator[PassResult]:
    """Each planned pass in order; a pass that raises is re-run ticket by ticket."""
    for p in plan:
        stats = RunStats()
        try:
            indices, preds, cost = next(iter(classify_passes(items, [p])))
            stats.add(cost)
            yield PassResult(tuple(indices), list(preds), stats)
            continue
        except Exception as pass_error:  # noqa: BLE001 - isolated below
            if p.size == 1:
                yield PassResult(p.indices, [pass_error], stats)
                continue
        out: list[Prediction | Exception] = []
        for i, length in zip(p.indices, p.lengths):
            try:
                _, preds, cost = next(iter(classify_passes(items, [Pass((i,), (length,))])))
            except Exception as e:  # noqa: BLE001 - this ticket's own failure
                out.append(e)
                continue
            out.append(preds[0])
            stats.add(cost)
        yield PassResult(p.indices, out, stats, split_retries=p.size)
