"""Operators' view of a running group, end to end: two real worker processes (tiny model) on one
stream, each serving Prometheus metrics, scraped over HTTP; ``triage-worker status`` run as a
subprocess against the same Redis; a "ghost" consumer that read entries and died.

The workers are module-scoped (start-up is the slow part); every test leaves them running.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import pytest
import redis

from tests.metrics_scrape import scrape
from tests.worker_proc import (
    REPO,
    WorkerProc,
    delete_keys,
    env_with,
    make_env,
    run_cli,
    start_worker,
    wait_ready_or_kill,
    wait_settled,
)
from worker import __version__
from worker.redis_server import free_port

GOOD_TEXTS = [
    "I was charged twice",
    "app crashes on start",
    "password reset email never arrives",
    "where is my parcel?",
]
BAD = {  # ticket id -> (fields, the reason class its dead letter must be counted under)
    "bad-no-text": ({"id": "bad-no-text", "body": "wrong field"}, "no_text"),
    "bad-meta": ({"id": "bad-meta", "text": "hello", "meta": "{customer: 1"}, "bad_meta"),
    "bad-empty": ({"id": "bad-empty", "text": "  "}, "empty_text"),
    "bad-latin1": ({"id": "bad-latin1", "text": "caf\u00e9".encode("latin-1")}, "not_utf8"),
}
GHOST_ENTRIES = 3


@dataclass
class Group:
    env: dict[str, str]
    workers: dict[str, WorkerProc]  # consumer name -> process
    ports: dict[str, int]  # consumer name -> metrics port
    good: list[str]  # input entry ids
    bad: list[str]


@pytest.fixture(scope="module")
def r(redis_url):
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture(scope="module")
def group(tiny_model_dir, redis_url, tmp_path_factory, r):
    prefix = f"triage-test:{uuid.uuid4().hex[:10]}:"
    env = make_env(
        tiny_model_dir,
        redis_url,
        prefix,
        tmp_path_factory.mktemp("cache"),
        TRIAGE_WINDOW_MAX_ITEMS=8,
        TRIAGE_PASS_MAX_ITEMS=8,
        TRIAGE_MAX_WAIT_MS=30,
        TRIAGE_CLAIM_IDLE_MS=600_000,
        TRIAGE_HEARTBEAT_TTL_S=120,
    )
    stream = env["TRIAGE_INPUT_STREAM"]
    # A consumer that read entries and died before any live worker started: they stay pending on it
    # (TRIAGE_CLAIM_IDLE_MS is 10 minutes), which `status` must show as a dead worker.
    r.xgroup_create(stream, "triage", id="0", mkstream=True)
    for i in range(GHOST_ENTRIES):
        r.xadd(stream, {"id": f"ghost-{i}", "text": "held by a dead worker"})
    assert len(r.xreadgroup("triage", "ghost-1", {stream: ">"}, count=GHOST_ENTRIES)[0][1]) == GHOST_ENTRIES
    tag = uuid.uuid4().hex[:6]
    ports = {f"obs-a-{tag}": free_port(), f"obs-b-{tag}": free_port()}
    workers = {
        name: start_worker(
            env_with(env, TRIAGE_CONSUMER=name, TRIAGE_METRICS_PORT=port, TRIAGE_METRICS_HOST="127.0.0.1"), ready=False
        )
        for name, port in ports.items()
    }
    try:
        for w in workers.values():
            wait_ready_or_kill(w, 180)
        good, bad = [], []
        # Each worker its half, the other frozen meanwhile (a stopped worker has no read in Redis that could take
        # them: it polls with scripts). Left to race, one worker read every ticket before the other polled (an idle
        # one polls every 100 ms after 30 s of quiet), and the tests of what each worker counted had nothing to see.
        first, second = workers.values()
        for half, frozen in enumerate((second, first)):
            frozen.freeze()
            try:
                ok = [
                    r.xadd(stream, {"id": f"ok-{i}", "text": GOOD_TEXTS[i % 4] + " " * (i % 5)})
                    for i in range(12 * half, 12 * half + 12)
                ]
                ko = [r.xadd(stream, fields) for fields, _ in list(BAD.values())[2 * half : 2 * half + 2]]
                wait_settled(r, env, ok + ko, timeout_s=120)
            finally:
                frozen.signal(signal.SIGCONT)
            good, bad = good + ok, bad + ko
        yield Group(env, workers, ports, good, bad)
    finally:
        for w in workers.values():
            w.kill()
        delete_keys(redis_url, prefix)


def written_by(r, env, consumer: str) -> tuple[list[dict], list[dict]]:
    results = [f for _, f in r.xrange(env["TRIAGE_RESULTS_STREAM"]) if f["worker"] == consumer]
    dead = [f for _, f in r.xrange(env["TRIAGE_DEAD_LETTER_STREAM"]) if f["worker"] == consumer]
    return results, dead


def scrape_settled(port: int, n_settled: int, w, timeout_s: float = 30) -> dict:
    """Scrape until the worker has observed ``n_settled`` entries (recorded just after the write) and counted as many
    windows as its ``window`` log lines read so far say (recorded after the window, logged after that, and read
    from its stderr by a thread of this process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port)
        settled = m.get(("triage_request_count_total", ())) == n_settled
        if settled and m.get(("triage_window_size_count", ())) == len(w.events("window")):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_metrics_endpoint_counts_what_each_worker_wrote(group, r):
    total_ok = 0
    for consumer, port in group.ports.items():
        results, dead = written_by(r, group.env, consumer)
        w = group.workers[consumer]
        m = scrape_settled(port, len(results) + len(dead), w)
        total_ok += len(results)
        assert m[("triage_request_count_total", ())] == len(results) + len(dead)
        assert m[("triage_request_success_total", ())] == len(results)
        want_failures = Counter(BAD[d["id"]][1] for d in dead)
        for reason in ("no_text", "bad_meta", "empty_text", "not_utf8", "poison", "model_error", "other"):
            assert m[("triage_request_failure_total", (("reason", reason),))] == want_failures.get(reason, 0), reason
        # end-to-end latency and input tokens: one observation per classified ticket
        assert m[("triage_request_duration_seconds_count", ())] == len(results)
        assert m[("triage_request_duration_seconds_bucket", (("le", "+Inf"),))] == len(results)
        assert m[("triage_request_input_tokens_count", ())] == len(results)
        assert m[("triage_request_input_tokens_sum", ())] == sum(int(f["tokens"]) for f in results)
        # windows and passes agree with the worker's own "window" log lines
        batches = w.events("window")
        assert m[("triage_window_size_count", ())] == len(batches)
        assert m[("triage_window_size_sum", ())] == len(results) + len(dead)
        assert m[("triage_window_entries_total", (("source", "new"),))] == len(results) + len(dead)
        for stage in ("read", "tokenization", "inference", "write"):
            assert m[(f"triage_window_{stage}_duration_seconds_count", ())] == len(batches), stage
        assert m[("triage_batch_next_size_sum", ())] == len(results)
        assert m[("triage_batch_next_size_count", ())] == sum(b["passes"] for b in batches)
        assert m[("triage_real_tokens_total", ())] == sum(b["real_tokens"] for b in batches)
        assert m[("triage_padded_tokens_total", ())] == sum(b["padded_tokens"] for b in batches)
        assert m[("triage_padded_tokens_total", ())] >= m[("triage_real_tokens_total", ())]
        # queue gauges: set from the last window's read (the ghost's entries keep pending >= 3)
        assert m[("triage_queue_pending", ())] >= GHOST_ENTRIES and ("triage_queue_size", ()) in m
        info = {k: v for (name, labels), v in m.items() if name == "triage_model_info" for k, v in labels}
        assert info == {
            "model": group.env["TRIAGE_MODEL"],
            "device": "cpu",
            "dtype": "fp32",
            "version": __version__,
            "consumer": consumer,
        }
        phases = {dict(labels)["phase"]: v for (name, labels), v in m.items() if name == "triage_worker_phase"}
        assert phases["reading"] + phases["idle"] == 1 and sum(phases.values()) == 1, phases
        assert m[("process_resident_memory_bytes", ())] > 0
    assert total_ok == len(r.xrange(group.env["TRIAGE_RESULTS_STREAM"]))


def test_status_shows_both_workers_backlog_pending_dead_letters_and_throughput(group, r):
    env, stream = group.env, group.env["TRIAGE_INPUT_STREAM"]
    names = sorted(group.workers)
    for w in group.workers.values():
        w.freeze()  # alive (heartbeat fresh for 120 s) but reading nothing: new tickets stay backlog (no read blocks
        # in Redis: a worker polls with scripts, so a stopped one has no read that could take them later)
    try:
        late = [r.xadd(stream, {"id": f"late-{i}", "text": "refund please"}) for i in range(5)]
        snap = run_cli(env, "status", "--json", "--window-s", "600")
        text = run_cli(env, "status", "--window-s", "600")
        soon = run_cli(env_with(env, TRIAGE_CLAIM_IDLE_MS=1), "status", "--json")
        watch = run_cli(env, "status", "--watch", "--json", "--interval-s", "0.1", "--count", "2")
        n = len(r.xrange(env["TRIAGE_RESULTS_STREAM"]))
        at_cap, over_cap = (
            run_cli(env, "status", *json_flag, "--window-s", "600", "--max-results", str(cap))
            for cap, json_flag in ((n, ["--json"]), (n - 1, []))
        )
    finally:
        for w in group.workers.values():
            w.signal(signal.SIGCONT)
    assert snap.returncode == 0, snap.stderr
    s = json.loads(snap.stdout)
    assert s["queue"]["backlog"] == 5 and s["queue"]["pending"] == GHOST_ENTRIES
    assert s["dead_letters"]["length"] == len(BAD) and s["dead_letters"]["in_window"] == len(BAD)
    assert s["dead_letters"]["by_reason"] == dict(Counter(cls for _, cls in BAD.values()))
    results = r.xrange(env["TRIAGE_RESULTS_STREAM"])
    assert s["results"]["count"] == len(results) == len(group.good) and s["results"]["per_s"] > 0
    lat = s["results"]["latency_ms"]
    assert lat["p50"] is not None and lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    rows = {w["consumer"]: w for w in s["workers"]}
    assert set(rows) == {*names, "ghost-1"}
    for name in names:
        row = rows[name]
        assert row["alive"] and row["state"] == "alive" and row["flags"] == [], row
        assert row["host"] == socket.gethostname() and row["pid"] == group.workers[name].pid
        assert row["model"] == env["TRIAGE_MODEL"] and row["pending"] == 0
        assert row["heartbeat_age_s"] is not None
        # Redis 7 adds a consumer to the group only when it first hands it an entry: each worker was handed its half
        assert row["idle_s"] is not None and all(written_by(r, env, name)), row
    assert sum(rows[n]["done_in_window"] for n in names) == len(results)
    ghost = rows["ghost-1"]
    assert not ghost["alive"] and ghost["state"] == "dead" and ghost["pending"] == GHOST_ENTRIES
    assert ghost["flags"] == ["dead"]  # idle far below TRIAGE_CLAIM_IDLE_MS=600000: not reclaimable yet
    assert s["summary"] == {
        "workers": 3,
        "alive": 2,
        "dead": 1,
        "gone": 0,
        "pending_on_dead": GHOST_ENTRIES,
        "reclaimable": 0,
    }
    # the same group seen with TRIAGE_CLAIM_IDLE_MS=1: the ghost's entries are up for XAUTOCLAIM
    ghost_soon = next(w for w in json.loads(soon.stdout)["workers"] if w["consumer"] == "ghost-1")
    assert ghost_soon["flags"] == ["dead", "reclaimable"]
    # the human table names every worker and the figures above
    assert text.returncode == 0, text.stderr
    for name in (*names, "ghost-1"):
        assert name in text.stdout
    assert "backlog 5  pending 3" in text.stdout and f"{len(BAD)} dead letters" in text.stdout
    assert "3 workers: 2 alive, 1 dead, 0 gone; 3 entries pending on dead workers" in text.stdout
    print(text.stdout)  # shown with -s: the sample in docs/worker.md comes from here
    # --max-results: all read at the cap; one under it, the count is a floor and said so (it read as the total)
    at_cap = json.loads(at_cap.stdout)["results"]
    assert at_cap["count"] == n and not at_cap["capped"] and at_cap["span_s"] == 600
    assert f"results  {n - 1:,}+ in the last 600s" in over_cap.stdout, over_cap.stdout
    # --watch --json: one object per refresh
    lines = watch.stdout.splitlines()
    assert watch.returncode == 0 and len(lines) == 2 and all(json.loads(x)["stream"] == stream for x in lines)
    # resumed workers take the backlog
    wait_settled(r, env, late, timeout_s=60)


def test_status_imports_neither_torch_nor_the_model(group):
    code = "import sys, worker.cli as c; rc = c.main(['status', '--json']); print(rc, 'torch' in sys.modules)"
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=group.env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "0 False", p.stdout[-500:]


def test_metrics_port_in_use_is_a_config_error_before_the_model_loads(triage_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        w = start_worker(env_with(triage_env, TRIAGE_METRICS_PORT=port, TRIAGE_METRICS_HOST="127.0.0.1"), ready=False)
        with w:
            assert w.wait(timeout_s=60) == 2, w.stderr_tail()
    err = w.events("metrics_unavailable")
    assert err and err[0]["port"] == port and "TRIAGE_METRICS_PORT" in err[0]["fix"]
    assert not w.events("model_loaded")


WINDOW = 16


def test_a_warm_stop_mid_pass_shows_stopping_in_the_heartbeat_and_the_metrics(triage_env, redis_url):
    """SIGTERM while a long pass runs: the heartbeat and the phase gauge say ``stopping`` (with the pass's clock)
    until the exit, so ops can tell a worker finishing its window from a busy one; the window is still written.
    The pass is held until the test has seen several beats (tests.held_passes): long on any CPU."""
    port = free_port()
    marked, release = triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "in-pass", triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "go"
    env = env_with(
        triage_env,
        TRIAGE_CONSUMER="stopping-a",
        TRIAGE_METRICS_PORT=port,
        TRIAGE_METRICS_HOST="127.0.0.1",
        TRIAGE_HEARTBEAT_TTL_S=1,  # a beat every ~0.33 s, several within the held pass
        TRIAGE_WINDOW_MAX_ITEMS=WINDOW,
        TRIAGE_PASS_MAX_ITEMS=WINDOW,
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_TEST_PRELOAD="tests.held_passes",
        TRIAGE_TEST_PASS_MARK=marked,
        TRIAGE_TEST_PASS_HOLD_UNTIL=release,
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    key = env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + "stopping-a"
    beats: list[dict] = []
    phases: list[float] = []  # the gauge's stopping value, one per scrape
    with client.pipeline() as pipe:  # queued before the start: one window of them, one pass
        for i in range(WINDOW):
            pipe.xadd(env["TRIAGE_INPUT_STREAM"], {"id": f"s-{i}", "text": f"my parcel is late #{i}"})
        pipe.execute()
    w = start_worker(env)
    with w:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the pass is running (held), and a beat has said so
            raw = client.get(key)
            if client.exists(marked) and raw and json.loads(raw)["phase"] == "inferring":
                break
            time.sleep(0.01)
        w.signal(signal.SIGTERM)
        while w.returncode is None and time.monotonic() < deadline:
            raw = client.get(key)
            if raw:
                beats.append(json.loads(raw))
            try:
                phases.append(scrape(port)[("triage_worker_phase", (("phase", "stopping"),))])
            except Exception:
                if client.exists(key):  # only a worker on its way out (heartbeat cleared) may cut a scrape short
                    raise
            if len({b["beat_at_ms"] for b in beats if b["phase"] == "stopping"}) >= 3:
                client.set(release, 1, ex=60)  # seen over several beats: let the pass run, the window be written
            time.sleep(0.02)
        assert w.wait(timeout_s=60) == 0, w.stderr_tail()
    assert client.exists(release), "the worker exited before its held pass was released"
    stopping = [b for b in beats if b["phase"] == "stopping"]
    assert stopping and isinstance(stopping[0]["pass_started_at_ms"], int), beats[-3:]
    assert {b["phase"] for b in beats} <= {"inferring", "stopping"}, beats
    assert 1.0 in phases and phases[-1] == 1.0, phases
    assert client.xlen(env["TRIAGE_RESULTS_STREAM"]) == WINDOW  # the warm stop finished the window in hand
    assert client.get(key) is None


def test_the_queue_gauges_follow_the_group_while_the_worker_is_idle(triage_env, redis_url):
    """The last window reads the group's state while its own entries are still pending; an idle worker's keeper
    reads it again on every beat, so pending falls back to 0 once they are acked (an alert on it would never clear)."""
    port = free_port()
    env = env_with(
        triage_env,
        TRIAGE_CONSUMER="queue-a",
        TRIAGE_METRICS_PORT=port,
        TRIAGE_METRICS_HOST="127.0.0.1",
        TRIAGE_HEARTBEAT_TTL_S=1,  # a beat every ~0.33 s
        TRIAGE_CLAIM_IDLE_MS=600_000,  # the keeper's other timer (refreshing held entries): every 200 s
        TRIAGE_MAX_WAIT_MS=0,
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    stream = env["TRIAGE_INPUT_STREAM"]
    with start_worker(env) as w:
        time.sleep(1.0)  # past the keeper's first round at start-up
        ids = [client.xadd(stream, {"id": f"q-{i}", "text": GOOD_TEXTS[i % 4]}) for i in range(5)]
        wait_settled(client, env, ids, timeout_s=120)
        windows = w.events("window")
        assert windows and max(win["pending"] for win in windows) > 0  # what the window saw: its own entries
        deadline = time.monotonic() + 30
        while scrape(port).get(("triage_queue_pending", ())) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        m = scrape(port)
        assert m[("triage_queue_pending", ())] == 0 and m[("triage_queue_size", ())] == 0
