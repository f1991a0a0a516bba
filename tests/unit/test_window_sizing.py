"""worker.stream.sizing: windows sized to about TRIAGE_WINDOW_TARGET_S of measured model work. Pure."""

from __future__ import annotations

import pytest

from worker.stream.sizing import WindowSizer


def test_off_always_asks_for_the_maximum():
    s = WindowSizer(0, max_items=256)
    s.read(16)
    assert s.cap() == 256  # no probe, prefetch as always
    s.observe(10, 10_000.0)  # 1 ticket/s would mean 5 tickets at 5 s: ignored when off
    assert s.cap() == 256


def test_a_small_probe_first_then_the_measured_rate_decides():
    s = WindowSizer(5.0, max_items=256, probe_items=16)
    assert s.cap() == 16
    s.read(16)
    s.observe(16, 4_000.0)  # 4 tickets/s (a CPU with a 135M LM)
    s.settled()
    assert s.cap() == 20  # 5 s of work, not 64 s of the old fixed 256
    assert s.cap() == 20  # measured: the next window may be prefetched


def test_one_probe_at_a_time_until_a_rate_is_known():
    s = WindowSizer(5.0, max_items=256, probe_items=16)
    assert s.cap() == 16 and s.cap() == 16  # asking is not reading: an empty stream leaves no probe out
    s.read(16)
    assert s.cap() == 0  # no second window of unknown size while the probe is out
    s.observe(0, 0.0)  # the probe held only dead letters: no rate
    s.settled()
    assert s.cap() == 16  # another probe


def test_fast_model_is_capped_by_the_maximum_and_a_slow_one_still_takes_one():
    fast = WindowSizer(5.0, max_items=4096)
    fast.cap()
    fast.observe(16, 4.0)  # 4,000 tickets/s
    assert fast.cap() == 4096
    slow = WindowSizer(5.0, max_items=256)
    slow.cap()
    slow.observe(2, 60_000.0)  # 30 s a ticket
    assert slow.cap() == 1


def test_probe_never_exceeds_the_maximum():
    assert WindowSizer(5.0, max_items=8, probe_items=16).cap() == 8


def test_rate_is_smoothed_and_empty_windows_say_nothing():
    s = WindowSizer(10.0, max_items=10_000, smoothing=0.5)
    s.observe(100, 1_000.0)  # 100/s
    s.observe(300, 1_000.0)  # 300/s: halfway -> 200/s
    assert s.cap() == 2000
    s.observe(0, 500.0)  # only dead letters: no pass ran
    s.observe(50, 0.0)
    assert s.cap() == 2000


def test_the_ramp_doubles_from_a_few_hundred_and_starts_again_after_an_empty_read():
    s = WindowSizer(0, max_items=4096, ramp_items=256)
    caps = []
    for _ in range(6):  # a backlog: every window is read full
        caps.append(s.cap())
        s.read(caps[-1])
    assert caps == [256, 512, 1024, 2048, 4096, 4096]
    s.read(300)  # the backlog ran low: the next window may take twice what this one found
    assert s.cap() == 600
    s.read(20)  # a trickle: the floor, not 40
    assert s.cap() == 256
    s.read(4096)
    s.idle()  # nothing came: a burst after the lull starts small again
    assert s.cap() == 256
    assert WindowSizer(0, max_items=4096).cap() == 4096  # no ramp: the maximum at once
    assert WindowSizer(0, max_items=64, ramp_items=256).cap() == 64  # never above the maximum


def test_the_ramp_and_the_measured_rate_take_the_smaller_cap():
    s = WindowSizer(1.0, max_items=4096, probe_items=16, ramp_items=256)
    assert s.cap() == 16  # the probe comes first
    s.read(16)
    s.observe(16, 1.0)  # 16,000 tickets/s: the rate allows the maximum
    s.settled()
    assert s.cap() == 256  # twice the probe is under the floor: the floor
    s.read(256)
    s.observe(256, 256.0)  # 1,000 tickets/s -> halfway: 8,500/s, 8,500 tickets at 1 s, capped at 4096
    assert s.cap() == 512  # the ramp is the smaller
    s.observe(4096, 40_960.0)  # 100 tickets/s, smoothed: ~4,300/s ... and then
    s.observe(4096, 40_960.0)  # ~2,200 tickets/s -> 2,200 at 1 s
    s.read(4096)
    assert s.cap() == int(s.items_per_s)  # now the rate is the smaller


@pytest.mark.parametrize(
    "kw", [{"target_s": -1}, {"max_items": 0}, {"probe_items": 0}, {"smoothing": 0}, {"ramp_items": -1}]
)
def test_bad_settings_are_refused(kw):
    args = {"target_s": 5.0, "max_items": 256, **kw}
    with pytest.raises(ValueError):
        WindowSizer(**args)


def test_the_default_read_budget_is_the_window_of_tickets_at_the_text_limit_up_to_64_mib():
    """4,096 tickets x 64 KiB (256 MiB) held Redis up to ~0.6 s per read script: the unset budget stops at 64 MiB;
    a set one is taken as it is."""
    from worker.stream.source import DEFAULT_READ_MAX_BYTES, ReadLimits

    assert ReadLimits(max_text_bytes=65_536).budget(256) == 256 * 65_536
    assert ReadLimits(max_text_bytes=65_536).budget(4096) == DEFAULT_READ_MAX_BYTES == 64 * 1024 * 1024
    assert ReadLimits(max_text_bytes=128 * 1024 * 1024).budget(4) == 128 * 1024 * 1024  # always one ticket's worth
    assert ReadLimits(max_text_bytes=65_536, max_bytes=1 << 30).budget(4096) == 1 << 30
