"""Pure logic behind the metrics and the status view: reason classes, the loop adapter, flags, rendering."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from worker.engine.types import PassStats, RunStats
from worker.observability.prometheus import Metrics, PrometheusMetrics
from worker.observability.reasons import REASON_CLASSES, reason_class
from worker.observability.status import _worker
from worker.observability.status_view import render
from worker.stream.messages import EntryFields, Rejected, parse_entry
from worker.stream.metrics import WindowMetrics
from worker.stream.sink import Outcome
from worker.stream.source import RawEntry
from worker.stream.window import Window, build_window, poison_reason, to_outcome

ENTRIES = {  # fields -> the class the worker's own reason sentence must fall into
    "no_text": {b"id": b"x", b"body": b"hi"},
    "empty_text": {b"text": b"  \n"},
    "not_utf8": {b"text": b"caf\xe9"},
    "too_large": {b"text": b"x" * 101},
    "bad_meta": {b"text": b"hi", b"meta": b"[1]"},
    "bad_id": {b"id": b"two\nlines", b"text": b"hi"},
    "deleted": {},
    "repeated_field": EntryFields([b"id", b"D-1", b"text", b"good text", b"text", b""]),
}


@pytest.mark.parametrize("want", sorted(ENTRIES))
def test_every_parse_rejection_has_its_own_reason_class(want):
    got = parse_entry("1-0", ENTRIES[want], max_text_bytes=100)
    assert isinstance(got, Rejected)
    assert reason_class(got.reason) == want, got.reason


@pytest.mark.parametrize("meta", [b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": "\\ud800"}'])
def test_meta_that_no_strict_json_reader_can_take_is_dead_lettered(meta):
    """Python's parser took these, and the results they were echoed into broke the producer CLI (a UnicodeEncodeError
    traceback on every `results` and `wait`) or were no JSON (NaN)."""
    got = parse_entry("1-0", {b"text": b"hi", b"meta": meta}, max_text_bytes=100)
    assert isinstance(got, Rejected) and reason_class(got.reason) == "bad_meta", got


def test_worker_made_reasons_are_classed_not_other():
    assert reason_class(poison_reason(6, 5)) == "poison"
    w = build_window([RawEntry("1-0", {b"text": b"hi"}, 1, "new")], "new", _raise, max_text_bytes=100, max_deliveries=5)
    assert reason_class(w.rejected[0][2]) == "tokenizer_error"
    w = Window(
        entries=[RawEntry("2-0", {b"text": b"hi"}, 1, "new")],
        source="new",
        tickets=[parse_entry("2-0", {b"text": b"hi"}, max_text_bytes=100)],
    )
    out, _ = to_outcome(w, [RuntimeError("CUDA out of memory")], model="m", worker="w")
    assert reason_class(out.dead_letters[0]["reason"]) == "model_error"
    assert reason_class("ticket is 900 tokens, over the 512-token limit (truncation is off)") == "too_many_tokens"
    assert reason_class("something new") == "other" and "other" in REASON_CLASSES


def _raise(texts):
    raise ValueError("tokenizer exploded")


def _window_metrics(stats: RunStats) -> WindowMetrics:
    return WindowMetrics(
        window=1,
        source="claimed",
        stats=stats,
        items=2,
        dead_lettered=1,
        read_ms=5.0,
        tokenize_ms=2.0,
        write_ms=4.0,
        backlog=7,
        pending=9,
    )


def _feed(m, passes: list[tuple[int, int, float]]) -> None:
    """What the loop does: each pass, then the written outcome, then the window."""
    run = _run(passes)
    m.on_passes(run)
    m.on_written(_written())
    m.on_window(_window_metrics(run))


def _written() -> Outcome:
    return Outcome(
        results=[
            {"stream_id": "1-0", "latency_ms": "1500.0", "tokens": "7"},
            {"stream_id": "2-0", "latency_ms": "20.5", "tokens": "9"},
        ],
        dead_letters=[{"stream_id": "3-0", "reason": "text is empty (or only whitespace); nothing to classify"}],
        ack_ids=["1-0", "2-0", "3-0"],
    )


def _run(passes: list[tuple[int, int, float]]) -> RunStats:
    """A RunStats made of passes (items, padded tokens, infer ms), as the engine builds it."""
    run = RunStats()
    for items, padded, infer_ms in passes:
        run.add(PassStats(items=items, real_tokens=padded - 5, padded_tokens=padded, infer_ms=infer_ms))
    return run


def test_windows_whose_first_pass_was_queued_early_are_counted():
    m = PrometheusMetrics(CollectorRegistry())
    early = _window_metrics(_run([(1, 25, 1.0)]))
    m.on_window(early)
    early.first_pass_early = True
    m.on_window(early)
    m.on_window(early)
    assert m.registry.get_sample_value("triage_windows_first_pass_early_total") == 2


def test_loop_hooks_feed_every_metric_from_the_loops_own_objects():
    m = PrometheusMetrics(CollectorRegistry())
    m.set_phase("reading")
    _feed(m, [(1, 25, 100.0), (1, 25, 200.0)])
    v = m.registry.get_sample_value
    assert v("triage_request_count_total") == 3 and v("triage_request_success_total") == 2
    assert v("triage_request_failure_total", {"reason": "empty_text"}) == 1
    assert v("triage_request_failure_total", {"reason": "poison"}) == 0  # pre-created: rate() works from the start
    assert v("triage_request_duration_seconds_count") == 2
    assert v("triage_request_duration_seconds_bucket", {"le": "1.0"}) == 1  # 20.5 ms in, 1.5 s out
    assert v("triage_request_input_tokens_sum") == 16
    assert v("triage_window_size_sum") == 3 and v("triage_window_entries_total", {"source": "claimed"}) == 3
    assert v("triage_window_inference_duration_seconds_sum") == pytest.approx(0.3)
    assert v("triage_windows_first_pass_early_total") == 0  # pre-created; a CPU's windows never are
    assert v("triage_batch_next_size_count") == 2 and v("triage_batch_next_size_sum") == 2
    assert v("triage_batch_inference_duration_seconds_count") == 2
    assert v("triage_real_tokens_total") == 40 and v("triage_padded_tokens_total") == 50
    assert v("triage_queue_size") == 7 and v("triage_queue_pending") == 9
    assert v("triage_worker_phase", {"phase": "reading"}) == 1 and v("triage_worker_phase", {"phase": "starting"}) == 0


def test_per_pass_records_feed_pass_tokens_and_durations():
    m = PrometheusMetrics(CollectorRegistry())
    _feed(m, [(3, 48, 120.0), (1, 9, 15.0)])
    v = m.registry.get_sample_value
    assert v("triage_batch_next_size_sum") == 4 and v("triage_batch_next_tokens_sum") == 57
    assert v("triage_batch_inference_duration_seconds_sum") == pytest.approx(0.135)


def test_cuda_graph_series_exist_only_where_graphs_do_and_count_from_the_totals():
    m = PrometheusMetrics(CollectorRegistry())
    v = m.registry.get_sample_value
    m.on_graphs(None)  # CPU: no graphs, no series (a 0 here would read as "turned off")
    assert v("triage_cuda_graphs_enabled") is None and v("triage_cuda_graph_replays_total") is None
    totals = {"enabled": True, "captures": 10, "replays": 40, "shapes": 10, "capture_s": 4.2, "eager_new_shape": 3}
    m.on_graphs(totals)
    m.on_graphs({**totals, "replays": 95, "captures": 11, "shapes": 11, "eager_new_shape": 5})  # running totals
    assert v("triage_cuda_graphs_enabled") == 1 and v("triage_cuda_graph_shapes") == 11
    assert v("triage_cuda_graph_replays_total") == 95 and v("triage_cuda_graph_captures_total") == 11
    assert v("triage_cuda_graph_eager_passes_total") == 5
    m.on_graphs({**totals, "enabled": False, "replays": 95, "captures": 11, "shapes": 0, "eager_new_shape": 5})
    assert v("triage_cuda_graphs_enabled") == 0 and v("triage_cuda_graph_replays_total") == 95  # off: alert on this


def test_phase_is_one_hot_and_unknown_phases_do_not_raise():
    m = PrometheusMetrics(CollectorRegistry())
    m.set_phase("inferring")
    m.set_phase("waiting-for-gpu")
    v = m.registry.get_sample_value
    assert v("triage_worker_phase", {"phase": "waiting-for-gpu"}) == 1
    assert v("triage_worker_phase", {"phase": "inferring"}) == 0
    assert v("triage_worker_phase", {"phase": "starting"}) == 0


def test_metrics_off_hooks_accept_the_same_calls():
    off = Metrics()
    off.set_phase("inferring")
    off.set_model(model="m", device="cpu", dtype="fp32", consumer="c")
    _feed(off, [(2, 8, 1.0)])
    off.reconnected()
    off.on_graphs({"enabled": True, "captures": 1, "replays": 1, "shapes": 1, "capture_s": 0.1, "eager_new_shape": 0})
    off.on_settled([{"latency_ms": 5.0, "tokens": 3}], ["ticket text is empty"])  # the RQ batch worker's hooks
    off.on_run(RunStats(real_tokens=3, padded_tokens=3), 0)
    assert not off.enabled


def test_metrics_off_has_every_hook_of_the_prometheus_metrics_with_its_signature():
    """The loop calls the hooks on whichever it was given: a hook only PrometheusMetrics has would be an
    AttributeError the moment metrics are off (the default). serve / close are the server's own, called only
    on a PrometheusMetrics."""
    import inspect

    own = {"serve", "close"}
    hooks = {n for n, f in vars(PrometheusMetrics).items() if callable(f) and not n.startswith("_")} - own
    for name in sorted(hooks):
        assert hasattr(Metrics, name), f"Metrics lacks {name}"
        assert inspect.signature(getattr(Metrics, name)) == inspect.signature(getattr(PrometheusMetrics, name)), name


NOW = 1_000_000_000


@pytest.mark.parametrize(
    "beat, xinfo, flags, state",
    [
        ({"beat_at_ms": NOW}, {"pending": 0, "idle": 10}, [], "alive"),
        ({"beat_at_ms": NOW}, None, ["not_read_yet"], "alive"),
        ({"beat_at_ms": NOW, "phase": "starting"}, None, ["not_read_yet"], "alive"),
        ({"beat_at_ms": NOW, "phase": "idle"}, None, [], "alive"),  # ready, never handed an entry: no consumer row
        ({"beat_at_ms": NOW}, {"pending": 4, "idle": 40_000}, ["slow"], "alive"),
        (None, {"pending": 3, "idle": 1_000}, ["dead"], "dead"),
        (None, {"pending": 3, "idle": 70_000}, ["dead", "reclaimable"], "dead"),
        (None, {"pending": 0, "idle": 70_000}, ["gone"], "gone"),
    ],
)
def test_worker_flags(beat, xinfo, flags, state):
    row = _worker("c", beat, xinfo, 0, NOW, claim_idle_ms=60_000)
    assert row["flags"] == flags and row["state"] == state


def test_render_shows_phase_and_pass_age_when_the_heartbeat_has_them():
    beat = {
        "host": "gpu-1",
        "pid": 42,
        "model": "bundled:smollm2",
        "beat_at_ms": NOW - 1_000,
        "phase": "inferring",
        "phase_since_ms": NOW - 3_000,
        "pass_started_at_ms": NOW - 2_000,
    }
    row = _worker("gpu-1-42", beat, {"pending": 64, "idle": 3_000}, 120, NOW, claim_idle_ms=60_000)
    assert row["phase_age_s"] == 3.0 and row["pass_age_s"] == 2.0
    snap = {
        "time_ms": NOW,
        "stream": "s",
        "group": "g",
        "claim_idle_ms": 60_000,
        "queue": {"exists": True, "length": 900, "backlog": 800, "pending": 64, "last_delivered_id": "1-0"},
        "results": {
            "window_s": 60.0,
            "count": 120,
            "per_s": 2.0,
            "newest_age_s": 0.5,
            "latency_ms": {"p50": 120.0, "p90": 900.0, "p99": 1500.0, "max": 2000.0},
        },
        "dead_letters": {"length": 2, "in_window": 1, "by_reason": {"bad_meta": 1}},
        "workers": [row],
        "summary": {"workers": 1, "alive": 1, "dead": 0, "gone": 0, "pending_on_dead": 0, "reclaimable": 0},
    }
    text = render(snap, "redis://r:6379/0")
    assert "1 worker: 1 alive, 0 dead, 0 gone" in text  # the counts add up to the workers (a gone one was missing)
    assert "inferring 3.0s (pass 2.0s)" in text and "gpu-1-42" in text and "bundled:smollm2" in text
    assert "backlog 800  pending 64" in text and "p99 1.5 s" in text and "(bad_meta 1)" in text
    stopping = _worker("gpu-1-42", {**beat, "phase": "stopping"}, None, 0, NOW, claim_idle_ms=60_000)
    assert "stopping 3.0s (pass 2.0s)" in render({**snap, "workers": [stopping]}, "redis://r:6379/0")


def test_worker_row_counts_windows_from_new_and_old_heartbeats():
    """The heartbeat's window counter is ``windows``; a worker from before the rename wrote ``batches``."""
    from worker.stream.health import Status

    status = Status()
    status.add(windows=3, items=90)
    beat = {"beat_at_ms": NOW, **status.snapshot()}
    assert beat["windows"] == 3 and beat["batches"] == 3  # the old name stays readable for existing probes
    assert _worker("new", beat, None, 0, NOW, claim_idle_ms=60_000)["windows"] == 3
    old = {"beat_at_ms": NOW, "batches": 7, "items": 9}
    assert _worker("old", old, None, 0, NOW, claim_idle_ms=60_000)["windows"] == 7


def test_a_stop_shows_as_stopping_from_the_next_beat_and_keeps_a_running_pass_clock():
    """The signal handler only sets the event; the keeper's next snapshot shows ``stopping`` (the pass in flight
    keeps its clock), and every later phase the loop enters stays ``stopping`` until the exit."""
    import threading

    from worker.stream.health import Status

    seen: list[str] = []
    stop = threading.Event()
    status = Status(on_phase=seen.append, stop=stop)
    status.pass_started()
    started = status.snapshot()["pass_started_at_ms"]
    assert status.snapshot()["phase"] == "inferring" and isinstance(started, int)
    stop.set()
    beat = status.snapshot()
    assert beat["phase"] == "stopping" and beat["pass_started_at_ms"] == started
    status.pass_started()  # the next pass of the window in hand still runs, under its own clock
    assert status.snapshot()["phase"] == "stopping" and status.snapshot()["pass_started_at_ms"] is not None
    status.set_phase("writing")
    beat = status.snapshot()
    assert beat["phase"] == "stopping" and beat["pass_started_at_ms"] is None
    assert seen == ["inferring", "stopping"]


def test_each_pass_start_asks_for_a_beat_not_only_a_change_of_phase():
    """From a window's second pass on the phase stays "inferring": only a change of phase asked the keeper for a beat,
    so the heartbeat's ``pass_started_at_ms`` kept the window's first pass for up to TTL/3 (``status`` showed a pass
    9.8 s old that had run 0.9 s). Each pass start now asks (the keeper still beats at most once per PHASE_BEAT_S)."""
    from worker.stream.health import Status

    asked: list[int] = []
    status = Status()
    status.on_moved = lambda: asked.append(1)
    status.pass_started()
    status.pass_started()
    status.set_phase("inferring")  # the same phase, the pass clock kept: nothing new to show
    assert len(asked) == 2
    status.set_phase("writing")
    assert len(asked) == 3


def test_the_move_out_of_starting_is_beaten_at_once_not_a_phase_beat_later(monkeypatch):
    """The start-up beat says "starting"; the loop's first phase was beaten only PHASE_BEAT_S after it, so a worker
    that had logged ``worker_ready`` (a tiny model loads in under a second) failed ``healthcheck --ready`` and
    showed ``not_read_yet`` in ``status`` meanwhile. The first move out of "starting" now skips that wait; later
    moves keep it (PHASE_BEAT_S made large here: without the exception the second beat would come a minute late)."""
    import threading

    from worker.stream import health

    monkeypatch.setattr(health, "PHASE_BEAT_S", 60.0)
    beaten: list[str] = []
    moved = threading.Condition()

    class Recorded:  # the keeper's view of a heartbeat: a beat returns None while the name is still ours
        ttl_s = 3600

        def beat(self, **status):
            with moved:
                beaten.append(status["phase"])
                moved.notify_all()

    class Refusing(Recorded):  # Redis refuses the beats (out of memory): tried once out of "starting", then limited
        def beat(self, **status):
            super().beat(**status)
            if status["phase"] != "starting":
                raise ConnectionError("refused")

    for heartbeat in (Recorded(), Refusing()):
        beaten.clear()
        status = health.Status()
        keeper = health.Keeper(
            heartbeat,
            status,
            refresh=None,
            refresh_interval_s=1.0,
            log=SimpleNamespace(warning=lambda *a, **k: None, debug=lambda *a, **k: None, info=lambda *a, **k: None),
        )
        keeper.start()
        try:
            with moved:
                assert moved.wait_for(lambda: beaten == ["starting"], timeout=10), beaten
            status.set_phase("reading")
            with moved:
                assert moved.wait_for(lambda: len(beaten) == 2, timeout=10), beaten
            status.set_phase("idle")  # an ordinary change of phase: rate-limited as before
            with moved:
                assert not moved.wait_for(lambda: len(beaten) == 3, timeout=0.5), beaten
        finally:
            keeper.stop()
        assert beaten == ["starting", "reading"], type(heartbeat).__name__
