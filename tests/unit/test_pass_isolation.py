"""worker.engine.isolation.run_passes: a failing pass is isolated ticket by ticket; worker.engine.pipeline.run_ahead:
the order passes are launched and read back in. Pure (fake engine)."""

from __future__ import annotations

import pytest

from worker.engine.bucketing import Pass
from worker.engine.isolation import run_passes
from worker.engine.pipeline import run_ahead
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


def _ahead(events: list, fail_launch=lambda p, items: False, **kw):
    """``classify_passes`` as the classifier builds it: ``run_ahead`` over a fake launch (events record the order)."""

    def classify_passes(items, passes, before_last=None):
        def launch(p):
            events.append(("launch", p.indices))
            if fail_launch(p, items):
                raise RuntimeError("CUDA out of memory")  # e.g. the largest pass's launch
            return p.indices

        def complete(p, launched):
            assert launched == p.indices
            events.append(("read", p.indices))
            return p.indices, [_pred() for _ in p.indices], PassStats(items=p.size, real_tokens=1, padded_tokens=1)

        return run_ahead(passes, launch, complete, ahead=True, before_last=before_last, **kw)

    return classify_passes


PLAN = [Pass((0, 1), (3, 3)), Pass((2, 3), (3, 3)), Pass((4,), (3,))]


def test_one_pass_in_flight_ahead_and_the_last_announced_before_its_read_back():
    events, announced = [], []
    fn = _ahead(events)
    out = [
        r[0] for r in fn([_prep(i) for i in range(5)], PLAN, lambda launched: announced.append((launched, len(events))))
    ]
    assert out == [(0, 1), (2, 3), (4,)]
    assert events == [
        ("launch", (0, 1)),
        ("launch", (2, 3)),  # queued before pass 0 is read back
        ("read", (0, 1)),
        ("launch", (4,)),
        ("read", (2, 3)),
        ("read", (4,)),
    ]
    assert announced == [((4,), 5)]  # once: the last pass launched, the others read back, it not yet
    events.clear()
    adopted = [r[0] for r in _ahead(events, adopt=lambda p: p.indices)([_prep(i) for i in range(5)], PLAN)]
    assert adopted == out and ("launch", (0, 1)) not in events  # the first pass's earlier launch is used


def test_without_lookahead_each_pass_is_read_back_before_the_next_is_launched():
    events = []
    run = run_ahead(
        PLAN, lambda p: events.append(("launch", p.size)), lambda p, _: events.append(("read", p.size)), ahead=False
    )
    list(run)
    assert events == [("launch", 2), ("read", 2), ("launch", 2), ("read", 2), ("launch", 1), ("read", 1)]


def test_a_launch_that_fails_is_its_own_passs_failure_not_the_pass_queued_before_it():
    """Pass 1's launch raises while pass 0 is in flight: pass 0 keeps its labels (no re-run); pass 1's tickets
    are re-run one by one; pass 2 runs as planned."""
    events = []
    fn = _ahead(events, fail_launch=lambda p, items: p.size > 1 and any(items[i].ids[0] == 13 for i in p.indices))
    items = [_prep(1), _prep(2), _prep(13), _prep(3), _prep(4)]
    out = list(run_passes(fn, PLAN, items))
    assert [r.indices for r in out] == [(0, 1), (2, 3), (4,)]
    assert [r.split_retries for r in out] == [0, 2, 0]
    assert all(p == _pred() for r in out for p in r.predictions)  # alone, ticket 13's launch is fine
    assert events.count(("read", (0, 1))) == 1 and ("launch", (2,)) in events and ("launch", (3,)) in events


def test_the_plans_end_is_announced_once_never_by_a_failed_passs_one_ticket_calls():
    """The worker takes the next window at ``before_last``: a failed pass's tickets re-run alone are not the
    window's end (before, each of those calls announced it, and the next window was queued mid-window)."""
    events, announced = [], []
    fn = _ahead(events, fail_launch=lambda p, items: p.size > 1 and any(items[i].ids[0] == 13 for i in p.indices))
    items = [_prep(13), _prep(1), _prep(2), _prep(3), _prep(4)]
    out = list(run_passes(fn, PLAN, items, before_last=announced.append))
    assert [r.split_retries for r in out] == [2, 0, 0]
    assert announced == [(4,)]  # once, by the call over the plan's rest, with its last pass in flight
