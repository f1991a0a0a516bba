"""worker.stream.metrics: the window/pass log lines and the summary period. Pure."""

from __future__ import annotations

import pytest

from worker.engine.launch import exclusive_ms
from worker.engine.types import PassStats, RunStats
from worker.stream.metrics import Summary, WindowMetrics, pass_line, percentile


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([10, 0, 5], 0) == 0 and percentile([10, 0, 5], 100) == 10
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_window_line_has_the_canonical_fields_from_the_engine_stats():
    stats = RunStats()
    stats.add(PassStats(items=3, real_tokens=20, padded_tokens=24, prefix_tokens_reused=30, infer_ms=10))
    stats.add(PassStats(items=1, real_tokens=10, padded_tokens=16, infer_ms=5))
    m = WindowMetrics(window=3, stats=stats, items=4, tokenize_ms=1, write_ms=4, latencies_ms=[10, 20, 30, 40])
    line = m.line()
    assert line["window"] == 3 and line["passes"] == 2 and line["infer_ms"] == 15.0
    assert line["padding_pct"] == 25.0 and line["items_per_s"] == 200.0
    assert line["latency_p50_ms"] == 25.0 and line["latency_p99_ms"] == pytest.approx(39.7)
    for key in ("prefix_tokens_reused", "read_ms", "backlog", "pending", "dead_lettered", "split_retries"):
        assert key in line
    p = pass_line(3, 1, stats, split_retries=0)
    assert (p["window"], p["pass"], p["items"], p["padding_pct"]) == (3, 1, 4, 25.0)
    # off CUDA: no device time, the model's work is infer_ms
    assert line["gpu_ms"] is None and p["gpu_ms"] is None and m.model_ms == 15.0


def test_on_cuda_a_windows_model_work_is_its_device_time_not_its_overlapping_pass_walls():
    stats = RunStats()
    for _ in range(3):  # a pass's wall on CUDA also holds the host's wait and work; the device time is the model's
        stats.add(PassStats(items=100, real_tokens=900, padded_tokens=900, infer_ms=40, gpu_ms=20.04))
    m = WindowMetrics(window=1, stats=stats, items=300)
    assert m.line()["gpu_ms"] == 60.1 and m.line()["infer_ms"] == 120.0
    assert pass_line(1, 0, stats)["gpu_ms"] == 60.1
    assert m.model_ms == pytest.approx(60.12)  # what the window sizer's rate is measured on


def test_a_pass_queued_behind_another_counts_the_wall_clock_from_that_ones_read_back():
    # pass 1 launched at 0 s, read back at 3 s; pass 2 launched at 1 s (queued behind it), read back at 5 s
    first, second = exclusive_ms(0.0, 0.0, 3.0), exclusive_ms(1.0, 3.0, 5.0)
    assert (first, second) == (3000.0, 2000.0) and first + second == 5000.0  # not 3 s + 4 s
    assert exclusive_ms(4.0, 3.0, 5.0) == 1000.0  # launched after the read-back: from its launch


def test_summary_covers_one_period_then_resets():
    s = Summary(period_s=10, now_s=100.0)
    assert not s.due(105.0) and s.due(110.0)
    stats = RunStats()
    stats.add(PassStats(items=50, real_tokens=90, padded_tokens=100))
    s.add(WindowMetrics(window=1, stats=stats, items=50, dead_lettered=2, latencies_ms=[1.0, 3.0]))
    line = s.take(110.0)
    assert (line["items"], line["dead_lettered"], line["items_per_s"], line["latency_p50_ms"]) == (50, 2, 5.0, 2.0)
    assert (line["windows"], line["passes"], line["padding_pct"]) == (1, 1, 10.0)
    assert s.take(120.0)["items"] == 0
