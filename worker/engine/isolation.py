"""Run the engine on a window (or an RQ batch) pass by pass, so that one bad ticket cannot fail its neighbours.

The tickets are planned into passes (length buckets, ``Classifier.plan``) and run by
``Classifier.classify_passes``, which hands back one pass at a time, so its results can be
written while the next pass runs. If a pass raises, its tickets are re-run alone: the ones
that pass get their label, the ones that still fail come back as the exception (the stream
worker dead-letters them with it as the reason, the RQ batch worker fails their jobs with it).
Exceptions of the ``fatal`` types are not isolated (RQ's job timeout: re-running after it
would run unbounded). Pure: no torch (the classifier is passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from worker.engine.bucketing import Pass
from worker.engine.types import InvalidTicket, PassStats, Prediction, Prepared, RunStats


def prepare_isolated(
    prepare: Callable[[Sequence[str]], list[Prepared | InvalidTicket]], texts: Sequence[str]
) -> list[Prepared | InvalidTicket]:
    """Tokenize in one call; if that call raises (one text no check foresaw), each text alone, so only the one that
    breaks the tokenizer comes back as an ``InvalidTicket`` (with the error), as a failed pass is re-run."""
    try:
        return list(prepare(texts)) if texts else []
    except Exception:  # noqa: BLE001 - isolated below
        out: list[Prepared | InvalidTicket] = []
        for text in texts:
            try:
                out.extend(prepare([text]))
            except Exception as e:  # noqa: BLE001 - this ticket's failure, never fatal
                out.append(InvalidTicket(f"the tokenizer failed on this ticket ({type(e).__name__}: {short(e)})"))
        return out


def short(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters (a reason, a log field)."""
    s = str(e).strip().replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


# classify_passes(items, passes[, before_last=]) -> (indices, predictions, cost) per pass
PassesFn = Callable[..., Iterable[tuple[tuple[int, ...], list[Prediction], PassStats]]]


@dataclass
class PassResult:
    """One planned pass of a window: its tickets (indices into the window's prepared items),
    a prediction or the exception per ticket, and what the forward calls cost."""

    indices: tuple[int, ...]
    predictions: list[Prediction | Exception]
    stats: RunStats = field(default_factory=RunStats)  # 1 forward call, or one per ticket after a failure
    split_retries: int = 0  # tickets re-run alone because the pass failed


def run_passes(
    classify_passes: PassesFn,
    plan: Sequence[Pass],
    items: Sequence[Prepared],
    fatal: tuple[type[BaseException], ...] = (),
    before_last: Callable | None = None,
) -> Iterator[PassResult]:
    """Each planned pass in order, from one ``classify_passes`` call over the whole plan (so an engine that
    queues pass k+1 before handing back pass k keeps doing so); a pass that raises is re-run ticket by
    ticket, and the passes after it continue in a new call. A ``fatal`` exception propagates as it is.

    ``before_last`` goes to the calls over the plan's rest (``classify_passes(..., before_last=)``: their
    last pass is the plan's), never to a failed pass's one-ticket calls, which are not the plan's end."""
    todo = list(plan)
    run = {"before_last": before_last} if before_last is not None else {}
    while todo:
        done = 0
        try:
            for indices, preds, cost in classify_passes(items, todo, **run):
                stats = RunStats()
                stats.add(cost)
                done += 1
                yield PassResult(tuple(indices), list(preds), stats)
            return
        except fatal:
            raise
        except Exception as pass_error:  # noqa: BLE001 - isolated below
            failed, todo = todo[done], todo[done + 1 :]
            yield _one_by_one(classify_passes, failed, items, pass_error, fatal)


def _one_by_one(
    classify_passes: PassesFn, p: Pass, items: Sequence[Prepared], pass_error: Exception, fatal: tuple = ()
) -> PassResult:
    """The tickets of a failed pass, each in a forward call of its own: its own prediction or its own error."""
    stats = RunStats()
    if p.size == 1:
        return PassResult(p.indices, [pass_error], stats)
    out: list[Prediction | Exception] = []
    for i, length in zip(p.indices, p.lengths):
        try:
            _, preds, cost = next(iter(classify_passes(items, [Pass((i,), (length,))])))
        except fatal:
            raise
        except Exception as e:  # noqa: BLE001 - this ticket's own failure
            out.append(e)
            continue
        out.append(preds[0])
        stats.add(cost)
    return PassResult(p.indices, out, stats, split_retries=p.size)
