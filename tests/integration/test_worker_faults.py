"""Faults with real processes and real sockets: kill -9 mid-batch and reclaim by a second
worker (--drain), Redis connection loss (lost EXEC, lost EXEC reply, outage) through a TCP
proxy, SIGTERM mid-stream.

Process starts (importing torch) dominate the run time on a busy box, so the proxied
worker is shared by the connection-loss test and the SIGTERM test that ends it, and the
poison-entry test runs in test_worker_e2e.py against the worker there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from urllib.parse import urlparse

import pytest
import redis
from transformers import AutoTokenizer

from tests.metrics_scrape import scrape
from tests.tcp_proxy import TcpProxy
from tests.tiny_model import edited_model
from tests.worker_proc import REPO, delete_keys, env_with, make_env, outcomes, run_cli, start_worker, wait_settled
from worker.redis_server import free_port
from worker.stream.scripts import settle_script

GROUP = "triage"


def push(r, env, n, tag, text="my parcel is late and the invoice is wrong, please help"):
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(env["TRIAGE_INPUT_STREAM"], {"id": f"{tag}-{i}", "text": f"{text} #{i}"})
    return pipe.execute()


def own_pending(r, env, consumer):
    for c in r.xpending(env["TRIAGE_INPUT_STREAM"], GROUP)["consumers"]:
        if c["name"] == consumer:
            return c["pending"]
    return 0


def test_kill9_mid_batch_then_second_worker_reclaims_everything(triage_env, redis_url):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    victim, rescuer = f"victim-{uuid.uuid4().hex[:6]}", f"rescuer-{uuid.uuid4().hex[:6]}"
    ids = push(r, triage_env, 60, "k")
    with start_worker(
        env_with(triage_env, TRIAGE_CONSUMER=victim, TRIAGE_WINDOW_MAX_ITEMS=8, TRIAGE_PASS_MAX_ITEMS=8)
    ) as a:
        stranded = _freeze_with_pending(r, triage_env, a, victim)
        a.kill()  # kill -9: no shutdown code runs
    assert own_pending(r, triage_env, victim) == stranded > 0
    # started once the victim is dead and its count taken: a rescuer started before could claim the stranded
    # entries (idle past 300 ms) before the count, had this test been held up between the two
    b = start_worker(
        env_with(triage_env, TRIAGE_CONSUMER=rescuer, TRIAGE_CLAIM_IDLE_MS=300), "run", "--drain", ready=False
    )
    with b:
        assert b.wait(120) == 0, b.stderr_tail()
    assert b.events("entries_claimed"), b.stderr_tail()
    settled = wait_settled(r, triage_env, ids, timeout_s=5)  # also fails on any id written twice
    assert all(kind == "result" for kind, _ in settled.values())
    by_rescuer = sum(rec["worker"] == rescuer for _, rec in settled.values())
    assert by_rescuer >= stranded
    assert r.xpending(triage_env["TRIAGE_INPUT_STREAM"], GROUP)["pending"] == 0
    assert b.events("worker_stopped")[-1]["reason"] == "drained"


def _freeze_with_pending(r, env, w, consumer, timeout_s=60.0) -> int:
    """SIGSTOP the worker at a moment it holds unacked entries; their count."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if own_pending(r, env, consumer) > 0:
            w.freeze()
            time.sleep(0.3)  # an EXEC already on the wire lands now
            n = own_pending(r, env, consumer)
            if n > 0:
                return n
            os.kill(w.pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError("worker never held pending entries")


@pytest.fixture(scope="module")
def proxy(redis_url):
    target = urlparse(redis_url)
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 6379) as p:
        p.url = redis_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{p.port}")
        yield p


@pytest.fixture(scope="module")
def proxied(tiny_model_dir, redis_url, tmp_path_factory, proxy):
    """(env, worker): a worker whose every Redis connection goes through ``proxy``; small batches."""
    prefix = f"triage-test:{uuid.uuid4().hex[:10]}:"
    env = make_env(
        tiny_model_dir,
        proxy.url,
        prefix,
        tmp_path_factory.mktemp("cache"),
        TRIAGE_RECONNECT_MAX_S=0.5,
        TRIAGE_WINDOW_MAX_ITEMS=2,
        TRIAGE_PASS_MAX_ITEMS=2,
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_METRICS_PORT=free_port(),
        TRIAGE_METRICS_HOST="127.0.0.1",
    )
    with start_worker(env) as w:
        yield env, w
    delete_keys(redis_url, prefix)


def test_redis_connection_loss_reconnects_and_writes_each_result_once(proxied, proxy, redis_url):
    env, w = proxied
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    # 1. the settle script never reaches Redis: the window is written after reconnecting
    settle = settle_script.sha.encode()  # not the heartbeat's EVALSHA, which the keeper sends meanwhile
    proxy.drop_at(b"EVALSHA", after=False, first_arg=settle)
    ids = push(r, env, 6, "before-exec")
    assert proxy.triggered.wait(30)
    wait_settled(r, env, ids)
    # 2. the settle script runs but its reply is lost: the retry sees the entries acked and writes nothing twice
    proxy.drop_at(b"EVALSHA", after=True, first_arg=settle)
    ids += push(r, env, 6, "after-exec")
    assert proxy.triggered.wait(30)
    wait_settled(r, env, ids)
    # 3. an outage: every connection reset, new ones refused, tickets keep arriving
    proxy.cut()
    ids += push(r, env, 6, "outage")
    w.wait_for(lambda e: e.get("event") == "redis_unavailable" and e.get("op") == "read", timeout_s=30)
    time.sleep(1.0)
    proxy.restore()
    settled = wait_settled(r, env, ids)  # fails if anything was written twice
    assert all(kind == "result" for kind, _ in settled.values())
    assert len([e for e in w.events("redis_unavailable") if e["op"] == "write"]) >= 2, w.stderr_tail()
    assert w.events("entries_not_ours_anymore"), "the lost-reply retry must notice the commit"
    assert w.events("redis_reconnected")
    assert w.returncode is None
    assert r.xpending(env["TRIAGE_INPUT_STREAM"], GROUP)["pending"] == 0
    # one reconnect per wait for Redis that ended (a redis_reconnected line), as the RQ worker counts: it counted
    # every failed try (7 for one outage that the RQ worker counted as 1)
    waits = len(w.events("redis_reconnected"))
    assert scrape(int(env["TRIAGE_METRICS_PORT"]))[("triage_redis_reconnects_total", ())] == waits


def test_latency_runs_to_the_write_that_lands_not_to_when_the_result_was_ready(proxied, proxy, redis_url):
    """``latency_ms`` is "enqueue -> result written"; it was stamped when the pass's records were built, so results
    whose write waited out an outage said up to seconds less (a metrics hunt: 16 of 40 records 3-4 s short, the
    histogram 130 s against 188 s). Now each write try stamps it: within a few ms of the results entry's own time."""
    env, _w = proxied
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    proxy.drop_at(b"EVALSHA", after=False, first_arg=settle_script.sha.encode())
    ids = push(r, env, 2, "late-write")
    assert proxy.triggered.wait(30)
    proxy.cut()  # the write's retries fail for a second
    time.sleep(1.0)
    proxy.restore()
    wait_settled(r, env, ids)
    for written_at, rec in r.xrange(env["TRIAGE_RESULTS_STREAM"]):
        if rec["stream_id"] in ids:
            to_write_ms = int(written_at.split("-")[0]) - int(rec["stream_id"].split("-")[0])
            assert to_write_ms - float(rec["latency_ms"]) < 500, (to_write_ms, rec["latency_ms"])


def test_sigterm_mid_stream_exits_0_loses_nothing_acks_nothing_unwritten(tiny_model_dir, redis_url, tmp_path):
    """A worker of its own (it is stopped here: the module's worker stays for the other tests, in any order)."""
    prefix = f"triage-test:{uuid.uuid4().hex[:10]}:"
    env = make_env(
        tiny_model_dir,
        redis_url,
        prefix,
        tmp_path / "cache",
        TRIAGE_WINDOW_MAX_ITEMS=2,
        TRIAGE_PASS_MAX_ITEMS=2,
        TRIAGE_MAX_WAIT_MS=0,
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    with start_worker(env) as w:
        _stop_mid_stream(r, env, w)
    delete_keys(redis_url, prefix)


def _stop_mid_stream(r, env, w) -> None:
    seen = len(w.events("window"))
    ids = push(r, env, 300, "t")
    deadline = time.monotonic() + 60
    while len(w.events("window")) <= seen:  # one window of the new tickets is done: mid-stream now
        assert time.monotonic() < deadline, w.stderr_tail()
        time.sleep(0.01)
    w.signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.stderr_tail()
    assert w.events("warm_shutdown") and w.events("worker_stopped")[-1]["reason"] == "signal SIGTERM"

    group = next(g for g in r.xinfo_groups(env["TRIAGE_INPUT_STREAM"]) if g["name"] == GROUP)
    assert group["pending"] == 0, "a warm stop finishes and acks everything it read"
    last = tuple(map(int, group["last-delivered-id"].split("-")))
    done = outcomes(r, env)
    delivered = [i for i in ids if tuple(map(int, i.split("-"))) <= last]
    assert 0 < len(delivered) < len(ids), "the signal should land mid-stream"
    for i in ids:
        recs = done.get(i, [])
        if i in delivered:  # acked => its result exists, exactly once
            assert [k for k, _ in recs] == ["result"], (i, recs)
        else:  # never read: still in the stream for the next worker
            assert recs == [], (i, recs)


def test_second_signal_exits_at_once(tmp_path):
    """Cold shutdown, in a real process with the worker's real handler (no model needed):
    the first SIGTERM only asks to stop, the second exits immediately with 128+15."""
    script = tmp_path / "cold.py"
    script.write_text(
        "import os, signal, time\n"
        "from worker.logs import configure_logging, get_logger\n"
        "from worker.stream.shutdown import Shutdown\n"
        "configure_logging('json')\n"
        "s = Shutdown(get_logger('t')); s.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "assert s.stop.wait(5)\n"
        "print('warm stop requested', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(10)\n"
        "print('still running', flush=True)\n"
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert p.stdout.splitlines() == ["warm stop requested"]
    assert '"event": "warm_shutdown"' in p.stderr and '"event": "cold_shutdown"' in p.stderr


def _closed_port_url() -> str:
    from worker.redis_server import free_port

    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: connection refused


def test_drain_against_unreachable_redis_gives_up_before_loading_the_model(triage_env):
    """--drain must not hang: Redis is checked first, the model is never loaded, exit code 3 with a clear reason."""
    env = env_with(
        triage_env, TRIAGE_REDIS_URL=_closed_port_url(), TRIAGE_DRAIN_REDIS_TIMEOUT_S=1, TRIAGE_RECONNECT_MAX_S=0.2
    )
    with start_worker(env, "run", "--drain", ready=False) as w:
        assert w.wait(timeout_s=120) == 3, w.stderr_tail()
    assert not w.events("model_loaded"), "Redis must be checked before the model loads"
    gave_up = w.events("redis_unreachable")
    assert gave_up and "TRIAGE_REDIS_URL" in gave_up[-1]["action"], w.stderr_tail()
    assert w.events("waiting_for_redis")


def test_run_waits_for_redis_before_loading_the_model(triage_env):
    """Run mode: a clear line, then wait and retry (as long as it takes); the first SIGTERM ends the wait."""
    env = env_with(triage_env, TRIAGE_REDIS_URL=_closed_port_url(), TRIAGE_RECONNECT_MAX_S=0.2)
    with start_worker(env, "run", ready=False) as w:
        w.wait_for(lambda e: e.get("event") == "redis_unavailable" and e.get("attempt", 0) >= 3, timeout_s=120)
        assert not w.events("model_loaded"), "Redis must be checked before the model loads"
        assert w.stop() == 0, w.stderr_tail()
    assert w.events("waiting_for_redis") and w.events("worker_stopped")


def test_results_key_of_another_type_stops_the_worker_before_anything_is_written(triage_env, redis_url):
    """Somebody replaces the results stream by a string while the worker runs: the settle script checks the
    key types first, so nothing of the window is written or acked; the worker stops (exit 1) for an operator."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    with start_worker(env_with(triage_env, TRIAGE_CONSUMER=f"wt-{uuid.uuid4().hex[:6]}")) as w:
        r.set(triage_env["TRIAGE_RESULTS_STREAM"], "not a stream")
        ids = push(r, triage_env, 3, "wrongtype")
        assert w.wait(timeout_s=60) == 1, w.stderr_tail()
    assert w.events("wrong_key_type"), w.stderr_tail()
    assert r.get(triage_env["TRIAGE_RESULTS_STREAM"]) == "not a stream"
    dead = triage_env["TRIAGE_DEAD_LETTER_STREAM"]
    assert not r.exists(dead) or r.xlen(dead) == 0
    pending = {e["message_id"] for e in r.xpending_range(triage_env["TRIAGE_INPUT_STREAM"], GROUP, "-", "+", 10)}
    assert pending == set(ids), "nothing may be acked without its result"
    for i in range(3):
        assert r.get(triage_env["TRIAGE_RESULT_KEY_PREFIX"] + f"wrongtype-{i}") is None


def test_a_worker_frozen_past_its_ttl_whose_name_was_taken_over_exits_2_and_leaves_the_name(triage_env, redis_url):
    """SIGSTOP past the heartbeat TTL (a stalled VM, a debugger): its key expires and a new process starts under the
    fixed TRIAGE_CONSUMER. On waking, the first must not take the name back (two processes under one name re-read
    each other's pending entries): its next beat finds the other's heartbeat, it stops (exit 2,
    consumer_name_lost) and leaves the name to the other. Every ticket gets one result."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    name = f"fixed-{uuid.uuid4().hex[:6]}"
    env = env_with(triage_env, TRIAGE_CONSUMER=name, TRIAGE_HEARTBEAT_TTL_S=2)
    key = env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + name
    ids = push(r, env, 8, "before")
    with start_worker(env) as first:
        wait_settled(r, env, ids)
        os.kill(first.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while r.exists(key) and time.monotonic() < deadline:  # its TTL runs out while it is frozen
                time.sleep(0.1)
            assert not r.exists(key)
            with start_worker(env) as second:
                ids += push(r, env, 8, "during")
                os.kill(first.pid, signal.SIGCONT)
                assert first.wait(60) == 2, first.stderr_tail()
                lost = first.events("consumer_name_lost")
                assert lost and lost[0]["holder_pid"] == second.pid, first.stderr_tail()
                assert first.events("worker_stopped")[-1]["reason"] == "consumer name lost"
                assert json.loads(r.get(key))["pid"] == second.pid
                ids += push(r, env, 8, "after")
                settled = wait_settled(r, env, ids)  # also fails on any id written twice
                assert all(kind == "result" for kind, _ in settled.values())
                assert second.returncode is None and not second.events("consumer_name_lost")
                assert second.stop() == 0, second.stderr_tail()
        finally:
            if first.returncode is None:
                os.kill(first.pid, signal.SIGCONT)


def test_a_fill_wait_past_the_default_socket_timeout_is_not_a_redis_outage(triage_env, redis_url):
    """The read that fills a window blocks up to TRIAGE_MAX_WAIT_MS; past the client's fixed 15 s socket timeout
    every fill ended in a TimeoutError, logged as redis_unavailable. The socket timeout now grows with the setting."""
    from worker.stream.connection import SOCKET_TIMEOUT_S

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    ids = push(r, triage_env, 1, "long-fill")
    env = env_with(triage_env, TRIAGE_MAX_WAIT_MS=int(SOCKET_TIMEOUT_S * 1000) + 1000)
    with start_worker(env, "run", "--drain", ready=False) as w:
        first = w.wait_for(lambda e: e.get("event") in ("window", "redis_unavailable"), timeout_s=180)
        assert first["event"] == "window" and first["items"] == 1, w.stderr_tail()
        assert w.wait(timeout_s=120) == 0, w.stderr_tail()
    assert not w.events("redis_unavailable"), w.stderr_tail()
    ((kind, rec),) = wait_settled(r, triage_env, ids).values()
    assert kind == "result" and rec["id"] == "long-fill-0"


def test_a_tight_token_limit_with_truncation_off_starts_and_refuses_only_the_long_tickets(triage_env, redis_url):
    """The start-up warm-up ticket was refused like a ticket over the limit: the worker (stream and RQ) stopped with
    an InvalidTicket traceback before it read anything."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    env = env_with(triage_env, TRIAGE_TRUNCATE="false", TRIAGE_MAX_INPUT_TOKENS=8)  # the warm-up sentence: 22
    short = push(r, triage_env, 1, "tight-short", text="hi")
    long = push(r, triage_env, 1, "tight-long")
    with start_worker(env, "run", "--drain") as w:
        assert w.wait(timeout_s=120) == 0, w.stderr_tail()
    results = {f["stream_id"] for _, f in r.xrange(triage_env["TRIAGE_RESULTS_STREAM"])}
    dead = {f["stream_id"]: f["reason"] for _, f in r.xrange(triage_env["TRIAGE_DEAD_LETTER_STREAM"])}
    assert results == set(short) and set(dead) == set(long), (results, dead)
    assert "-token limit (truncation is off)" in dead[long[0]]


def test_claimed_entries_deleted_from_the_stream_count_in_the_workers_totals(triage_env, redis_url):
    """A dead consumer's pending entry deleted from the stream (XDEL) gets its dead letter from whoever claims it.
    That letter belongs to no window; the summary and ``worker_stopped`` counted only windows' letters, so ops read
    fewer dead letters there than the dead-letter stream held."""
    from worker.stream.messages import DELETED_REASON

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    stream = triage_env["TRIAGE_INPUT_STREAM"]
    ids = push(r, triage_env, 4, "orphan")
    r.xgroup_create(stream, GROUP, id="0")
    r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=4)  # a consumer that died holding them
    r.xdel(stream, ids[1])
    with start_worker(env_with(triage_env, TRIAGE_CLAIM_IDLE_MS=100), "run", "--drain", ready=False) as w:
        assert w.wait(120) == 0, w.stderr_tail()
    settled = wait_settled(r, triage_env, ids, timeout_s=5)
    assert settled[ids[1]][0] == "dead" and settled[ids[1]][1]["reason"] == DELETED_REASON
    assert [kind for i, (kind, _) in settled.items() if i != ids[1]] == ["result"] * 3
    stopped = w.events("worker_stopped")[-1]
    assert (stopped["items"], stopped["dead_lettered"]) == (3, 1), stopped
    assert sum(s["dead_lettered"] for s in w.events("summary")) == 1


def test_a_pass_the_model_fails_is_split_and_only_the_failing_tickets_are_dead_lettered(
    triage_env, redis_url, tmp_path
):
    """A real worker on a model that overflows on one token: a 4-ticket pass holding it is re-run ticket by
    ticket, its neighbours get their labels and the ticket a dead letter with the reason; a 1-ticket pass holding
    it (nothing to split) is dead-lettered too. Each failed pass has its ``pass_failed_split`` line (a 1-ticket
    one had none) and the worker drains on to exit 0."""
    poison = "\u01c2"  # a byte (0xC7) in no prompt, example or warm-up sentence
    token = AutoTokenizer.from_pretrained(triage_env["TRIAGE_MODEL"])(poison, add_special_tokens=False)["input_ids"][0]
    edited_model(triage_env["TRIAGE_MODEL"], tmp_path / "overflowing", lambda emb: emb[token].fill_(float("inf")))
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    clean = "my parcel is late and the invoice is wrong, please help"
    first = push(r, triage_env, 3, "ovf-a", text=clean) + push(r, triage_env, 1, "ovf-b", text=f"{clean} {poison}")
    lone = push(r, triage_env, 1, "ovf-c", text=f"{poison} {clean}")
    env = env_with(
        triage_env,
        TRIAGE_MODEL=str(tmp_path / "overflowing"),
        TRIAGE_WINDOW_MAX_ITEMS=4,  # two windows: the four, then the lone one
        TRIAGE_PASS_OVERHEAD_TOKENS=100_000,  # each window one pass
    )
    with start_worker(env, "run", "--drain", ready=False) as w:
        assert w.wait(120) == 0, w.stderr_tail()
    settled = wait_settled(r, triage_env, first + lone, timeout_s=5)
    assert [settled[i][0] for i in first[:3]] == ["result"] * 3, settled
    for i in (first[3], lone[0]):
        kind, rec = settled[i]
        assert kind == "dead" and "not finite" in rec["reason"], (token, rec)
    failed = sorted((e["items"], e["failed_alone"]) for e in w.events("pass_failed_split"))
    assert failed == [(1, 1), (4, 1)], (failed, w.events("pass"))


def test_a_cold_shutdown_releases_the_heartbeat_and_leaves_the_window_pending(triage_env, redis_url):
    """Two SIGTERMs mid-window: exit 128+15 at once, the entries in hand stay pending for a reclaim, and the heartbeat
    goes with the process (status and healthcheck said "alive" for a TTL after it was gone)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    consumer = f"cold-{uuid.uuid4().hex[:6]}"
    key = triage_env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + consumer
    marked = triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "in-pass"
    env = env_with(
        triage_env,
        TRIAGE_CONSUMER=consumer,
        TRIAGE_HEARTBEAT_TTL_S=60,
        TRIAGE_WINDOW_MAX_ITEMS=64,
        TRIAGE_PASS_MAX_ITEMS=64,
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_TEST_PRELOAD="tests.held_passes",  # its pass held (never released): the window stays in hand
        TRIAGE_TEST_PASS_MARK=marked,
        TRIAGE_TEST_PASS_HOLD_UNTIL=triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "never",
    )
    push(r, triage_env, 64, "cold")
    with start_worker(env) as w:
        deadline = time.monotonic() + 60
        while not r.exists(marked) and time.monotonic() < deadline:  # the window in hand, in its pass
            time.sleep(0.01)
        w.signal(signal.SIGTERM)
        w.wait_for("warm_shutdown")
        w.signal(signal.SIGTERM)
        assert w.wait(timeout_s=30) == 128 + signal.SIGTERM, w.stderr_tail()
    assert w.events("cold_shutdown") and not w.events("cold_shutdown_release_failed"), w.stderr_tail()
    assert r.get(key) is None and own_pending(r, triage_env, consumer) == 64
    health = run_cli(env, "healthcheck", "--consumer", consumer)
    assert health.returncode == 1, health.stdout + health.stderr
