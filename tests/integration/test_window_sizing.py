"""Windows sized by measured work (TRIAGE_WINDOW_TARGET_S): a real worker drains a real stream; each
window asks for what the rate measured on the windows before it allows, never more than the maximum."""

from __future__ import annotations

import time

import redis

from tests.worker_proc import env_with, start_worker

N = 60


def _drain(env: dict, redis_url: str, prefix: str, text: str):
    """Push N tickets (ids ``prefix-i``, ``text`` with i), drain them with ``run --drain``: (client, worker)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    for i in range(N):
        r.xadd(env["TRIAGE_INPUT_STREAM"], {"id": f"{prefix}-{i}", "text": text.format(i)})
    with start_worker(env, "run", "--drain", ready=False) as w:
        assert w.wait(120) == 0, w.stderr_tail()
    return r, w


def test_windows_ask_for_target_seconds_of_measured_work(triage_env, redis_url):
    # 1 ms of work is far below one window of the tiny model: after the probe window (16 tickets, nothing
    # prefetched beside it), each window asks for a handful of tickets at most, not the maximum of 64
    env = env_with(
        triage_env,
        TRIAGE_WINDOW_TARGET_S=0.001,
        TRIAGE_WINDOW_MAX_ITEMS=64,
        TRIAGE_PASS_MAX_ITEMS=16,
        TRIAGE_TOKENIZE_THREADS=3,  # not this box's CPU count: the setting, not the default
        TRIAGE_PASS_OVERHEAD_TOKENS="auto",
    )
    r, w = _drain(env, redis_url, "ws", "my invoice {} shows a double charge")
    loaded = w.events("model_loaded")[0]
    assert loaded["tokenize_threads"] == 3  # the reader tokenizes on the library's pool
    assert "cuda_graphs_warm_up" in loaded and loaded["cuda_graphs_warm_up"] is None  # no CUDA graphs on a CPU
    # TRIAGE_PASS_OVERHEAD_TOKENS=auto: measured at start-up, within the pass budget
    assert isinstance(loaded["pass_overhead_tokens"], int) and 0 <= loaded["pass_overhead_tokens"] <= 8192

    ready = w.events("worker_ready")[0]
    assert (ready["window_max_items"], ready["window_target_s"], ready["window_probe_items"]) == (64, 0.001, 16)
    assert ready["redis_parser"] == "hiredis"  # the declared dependency is what the worker parses replies with
    windows = w.events("window")
    caps = [e["cap_items"] for e in windows]
    assert caps[0] == 16
    assert all(e["items"] + e["dead_lettered"] <= e["cap_items"] for e in windows)
    assert max(caps[1:]) < 16 and len(windows) > N // 16  # smaller windows than the fixed size would give
    results = r.xrange(env["TRIAGE_RESULTS_STREAM"])
    assert sorted(f["id"] for _, f in results) == sorted(f"ws-{i}" for i in range(N))  # nothing lost or doubled


def test_target_zero_keeps_fixed_windows(triage_env, redis_url):
    env = env_with(
        triage_env,
        TRIAGE_WINDOW_TARGET_S=0,
        TRIAGE_WINDOW_MAX_ITEMS=24,
        TRIAGE_PASS_MAX_ITEMS=8,
        TRIAGE_PASS_OVERHEAD_TOKENS=7,
    )
    r, w = _drain(env, redis_url, "wf", "where is parcel {}")
    assert w.events("model_loaded")[0]["pass_overhead_tokens"] == 7  # a number set is used as it is, not measured

    assert {e["cap_items"] for e in w.events("window")} == {24}
    assert len(r.xrange(env["TRIAGE_RESULTS_STREAM"])) == N


def test_windows_ramp_up_from_the_ramp_size_on_a_backlog(triage_env, redis_url):
    """A backlog at start-up: the first window is small, so the model starts soon; each next one at most doubles."""
    env = env_with(triage_env, TRIAGE_WINDOW_MAX_ITEMS=64, TRIAGE_WINDOW_RAMP_ITEMS=8, TRIAGE_PASS_MAX_ITEMS=8)
    r, w = _drain(env, redis_url, "wr", "refund for order {} please")
    assert w.events("worker_ready")[0]["window_ramp_items"] == 8
    windows = w.events("window")
    assert [e["cap_items"] for e in windows] == [8, 16, 32, 64]
    assert [e["items"] for e in windows] == [8, 16, 32, N - 56]
    assert len(r.xrange(env["TRIAGE_RESULTS_STREAM"])) == N


def test_a_worker_started_on_an_empty_stream_still_probes_when_tickets_come(triage_env, redis_url):
    """Reads that find nothing are not the probe window: the first tickets to arrive are read and classified."""
    env = env_with(triage_env, TRIAGE_WINDOW_TARGET_S=5, TRIAGE_WINDOW_MAX_ITEMS=64)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    with start_worker(env) as w:
        time.sleep(1.5)  # at least two empty blocking reads (0.5 s each) before anything arrives
        for i in range(20):
            r.xadd(env["TRIAGE_INPUT_STREAM"], {"id": f"we-{i}", "text": f"cannot log in to account {i}"})
        deadline = time.monotonic() + 60
        while r.xlen(env["TRIAGE_RESULTS_STREAM"]) < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.xlen(env["TRIAGE_RESULTS_STREAM"]) == 20, w.stderr_tail()
        assert w.stop() == 0, w.stderr_tail()
    assert w.events("window")[0]["cap_items"] == 16  # the probe
