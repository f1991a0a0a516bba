"""worker.engine.isolation.run_passes: a failing pass is isolated ticket by ticket. Pure (fake engine)."""

from __future__ import annotations

import pytest

from worker.engine.bucketing import Pass
from worker.engine.isolation import run_passes
from worker.engine.types import PassStats, Prediction, Prepared


def _pred(label="billing"):
    return Prediction(label=label, scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=3)


def _prep(tag: int):
    return Prepared(ids=(tag, 1, 2), n_text_tokens=1, truncated=False)


def test_a_failing_pass_is_rerun_ticket_by_ticket_and_the_others_are_untouched():
    calls = []

    def classify_passes(items, passes):
        for p in passes:
            calls.append(p.size)
            if any(items[i].ids[0] == 13 for i in p.indices):
                raise RuntimeError("bad tensor")
            yield (
                p.indices,
                [_pred() for _ in p.indices],
                PassStats(items=p.size, real_tokens=3 * p.size, padded_tokens=3 * p.size),
            )

    items = [_prep(1), _prep(13), _prep(2), _prep(4)]
    plan = [Pass((0, 1, 2), (3, 3, 3)), Pass((3,), (3,))]
    out = list(run_passes(classify_passes, plan, items))
    assert calls == [3, 1, 1, 1, 1]
    assert [r.indices for r in out] == [(0, 1, 2), (3,)] and [r.split_retries for r in out] == [3, 0]
    assert isinstance(out[0].predictions[1], RuntimeError) and out[0].predictions[0] == out[0].predictions[2] == _pred()
    assert (out[0].stats.passes, out[0].stats.items, out[0].stats.real_tokens) == (2, 2, 6)
    assert out[1].predictions == [_pred()] and out[1].stats.passes == 1


class Deadline(Exception):
    """Stands in for RQ's JobTimeoutException: the batch's time is up."""


def test_a_fatal_exception_is_not_isolated_but_propagates():
    """After a batch's timeout, re-running its tickets one by one would run with no limit at all."""
    calls = []

    def classify_passes(items, passes):
        for p in passes:
            calls.append(p.size)
            raise Deadline("job exceeded maximum timeout value")
            yield  # pragma: no cover - a generator, as the engine's

    items = [_prep(1), _prep(2)]
    with pytest.raises(Deadline):
        list(run_passes(classify_passes, [Pass((0, 1), (3, 3))], items, fatal=(Deadline,)))
    assert calls == [2]  # not re-run alone
    calls.clear()
    out = list(run_passes(classify_passes, [Pass((0, 1), (3, 3))], items))  # not fatal: isolated, each fails alone
    assert calls == [2, 1, 1] and all(isinstance(p, Deadline) for p in out[0].predictions)
