"""Pure pass planning: no torch, no Redis."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.bucketing import padding_stats, plan_arrival_order, plan_passes


def test_sorted_by_length_and_capped_by_items():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    passes = plan_passes(lengths, max_items=3, max_tokens=1000)
    flat = [i for b in passes for i in b.indices]
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert len(passes) == 3 and all(b.size <= 3 for b in passes)
    assert sorted(flat) == list(range(len(lengths)))


def test_token_budget_counts_padding():
    # 5 items of length 10 -> 50 padded tokens; a budget of 30 allows at most 3 per batch.
    passes = plan_passes([10] * 5, max_items=100, max_tokens=30)
    assert sorted(b.size for b in passes) == [2, 3]
    assert all(b.padded_tokens <= 30 for b in passes)


def test_short_items_are_not_padded_up_to_an_outlier():
    # A greedy fill would put the 400-token item with eight short ones (3600 padded tokens).
    lengths = [78] * 8 + [400]
    passes = plan_passes(lengths, max_items=32, max_tokens=4096, overhead_tokens=64)
    assert [b.lengths for b in passes] == [(78,) * 8, (400,)]


def test_overhead_trades_padding_for_fewer_calls():
    lengths = [10, 11, 12, 13]
    assert len(plan_passes(lengths, 8, 1000, overhead_tokens=0)) == 4  # free calls: no padding at all
    assert len(plan_passes(lengths, 8, 1000, overhead_tokens=100)) == 1


def test_budget_uses_longest_item_not_sum():
    # lengths 1,1,1,10: sum is 13 but padded cost of all four is 40 > 20
    passes = plan_passes([1, 1, 1, 10], max_items=100, max_tokens=20)
    assert [b.lengths for b in passes] == [(1, 1, 1), (10,)]


def test_oversized_item_goes_alone():
    passes = plan_passes([4, 500, 6], max_items=8, max_tokens=64)
    assert [b.lengths for b in passes] == [(4, 6), (500,)]


def test_ties_keep_arrival_order():
    passes = plan_passes([3, 3, 3, 3], max_items=2, max_tokens=100)
    assert [b.indices for b in passes] == [(0, 1), (2, 3)]


def test_padding_accounting():
    passes = plan_passes([2, 4, 4, 8], max_items=2, max_tokens=100)
    stats = padding_stats(passes)
    assert stats.real_tokens == 18
    assert stats.padded_tokens == 2 * 4 + 2 * 8
    assert stats.padding_pct == pytest.approx(100 * 6 / 24)
    glob = padding_stats(plan_arrival_order([2, 4, 4, 8], 2), pad_to=8)
    assert glob.padded_tokens == 32 and glob.waste_factor == pytest.approx(32 / 18)


def test_bucketing_beats_arrival_order_on_long_tail():
    lengths = [30 + (i * 37) % 50 for i in range(200)] + [900, 700, 400]
    bucketed = padding_stats(plan_passes(lengths, 32, 4096))
    arrival = padding_stats(plan_arrival_order(lengths, 32))
    assert bucketed.padding_pct < 5 < arrival.padding_pct


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        plan_passes([1, 2], 0, 10)
    with pytest.raises(ValueError):
        plan_passes([0, 2], 2, 10)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), max_size=80),
    max_items=st.integers(1, 16),
    max_tokens=st.integers(1, 2000),
)
def test_plan_invariants(lengths, max_items, max_tokens):
    passes = plan_passes(lengths, max_items, max_tokens)
    flat = [i for b in passes for i in b.indices]
    assert sorted(flat) == list(range(len(lengths)))  # every item exactly once
    for b in passes:
        assert b.size <= max_items
        assert b.size == 1 or b.padded_tokens <= max_tokens  # only a lone item may exceed
        assert list(b.lengths) == sorted(b.lengths)


def test_module_is_pure():
    code = "import sys, worker.engine.bucketing; assert not {'torch', 'redis'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_percentile_and_padding_helper_for_everybody():
    from worker.engine.types import PassStats, RunStats, padding_pct, percentile

    assert percentile([1, 2, 3, 4], 50) == 2.5  # linear interpolation (numpy's default)
    assert percentile([1, 2, 3, 4], 50, nearest=True) == 2  # nearest rank: a value that occurred
    assert percentile([3, 1, 2], 100, nearest=True) == 3 and percentile([], 50, nearest=True) is None
    assert padding_pct(75, 100) == 25.0 and padding_pct(0, 0) == 0.0
    run = RunStats()
    run.add(PassStats(items=2, real_tokens=6, padded_tokens=8, prefix_tokens_reused=10, infer_ms=1.5))
    run.add(PassStats(items=1, real_tokens=4, padded_tokens=4))
    assert (run.items, run.passes, run.pass_sizes, run.prefix_tokens_reused) == (3, 2, [2, 1], 10)
    assert run.padding_pct == padding_pct(10, 12) == padding_stats(plan_arrival_order([4, 2, 4], 2)).padding_pct
