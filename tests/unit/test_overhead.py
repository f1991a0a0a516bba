"""TRIAGE_PASS_OVERHEAD_TOKENS=auto: the fit of a pass's fixed cost, and which passes are timed (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from worker.engine import overhead
from worker.engine.types import EngineOptions, Prepared


def test_fixed_cost_over_cost_per_token():
    # 10 ms a call + 0.1 ms a token: 48 tokens alone 14.8 ms, 8 rows of them 48.4 ms -> 100 token-equivalents
    assert overhead.overhead_tokens(0.0148, 0.0484, 48, 8, cap=8192) == 100


def test_a_pass_that_costs_no_more_for_more_rows_is_all_fixed_cost():
    assert overhead.overhead_tokens(0.010, 0.010, 48, 8, cap=4096) == 4096
    assert overhead.overhead_tokens(0.010, 0.009, 48, 8, cap=4096) == 4096


def test_bounds_zero_and_the_pass_budget():
    assert overhead.overhead_tokens(0.0048, 0.0400, 48, 8, cap=8192) == 0  # noise: a negative fixed part
    assert overhead.overhead_tokens(1.0, 1.0336, 48, 8, cap=512) == 512


@dataclass
class _Framing:
    limit: int = 512

    def tokenize(self, texts):
        return [list(range(len(t.split()))) for t in texts]

    def frame(self, ids):
        return (1, *ids[: self.limit], 2)


class _Clf:
    """Times come from a line (fixed + per token) instead of a clock: the protocol, not the box, is tested."""

    def __init__(self, options, fixed_s=0.010, per_token_s=0.0001, first_extra_s=0.5):
        self.options, self.framing, self.aux_framing = options, _Framing(), None
        self.fixed_s, self.per_token_s, self.first_extra_s = fixed_s, per_token_s, first_extra_s
        self.passes: list[int] = []

    def cost_length(self, p: Prepared) -> int:
        return len(p.ids)

    def seconds(self, items) -> float:
        self.passes.append(len(items))
        extra = self.first_extra_s if len(self.passes) == 1 else 0.0  # lazy set-up of the first pass
        return extra + self.fixed_s + self.per_token_s * sum(len(p.ids) for p in items)


@pytest.fixture
def fake_clock(monkeypatch):
    monkeypatch.setattr(overhead, "_seconds", lambda clf, items: clf.seconds(items))


def test_measure_times_one_row_and_a_few_rows_and_keeps_the_best(fake_clock):
    clf = _Clf(EngineOptions())
    assert overhead.measure(clf) == 100  # 10 ms / 0.1 ms a token; the slow first pass is not counted
    assert clf.passes == [overhead.ROWS] + [1, overhead.ROWS] * overhead.REPEATS
    row = overhead.synthetic_row(clf)
    assert len(row.ids) == overhead.ROW_TOKENS + 2 and not row.truncated


def test_measure_respects_the_pass_caps(fake_clock):
    clf = _Clf(EngineOptions(pass_max_items=3))
    overhead.measure(clf)
    assert max(clf.passes) == 3
    clf = _Clf(EngineOptions(pass_max_tokens=3 * (overhead.ROW_TOKENS + 2)))
    overhead.measure(clf)
    assert max(clf.passes) == 3


def test_one_ticket_passes_leave_nothing_to_measure(fake_clock):
    clf = _Clf(EngineOptions(pass_max_items=1))
    assert overhead.measure(clf) == overhead.FALLBACK_TOKENS and clf.passes == []
