"""Heartbeat.claim on a real Redis: one live process per consumer name (as rq refuses a live worker's name).

Two processes under one TRIAGE_CONSUMER re-read each other's pending entries (duplicates, delivery counts pushed
towards TRIAGE_MAX_DELIVERIES), so the second is refused while the first keeps beating; a dead holder's key is
waited out, never blocking a restart for longer than the heartbeat's TTL. Every beat is a compare-and-set: a process
frozen past its TTL whose name was taken over meanwhile writes nothing, is told, and leaves the other's key at exit."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import redis

from worker.logs import get_logger
from worker.stream.health import Claim, Heartbeat, Keeper, NameInUse, Status
from worker.stream.scripts import heartbeat_script


@pytest.fixture
def client(redis_url):
    return redis.Redis.from_url(redis_url)


def _other(beat_at_ms: int, **extra) -> str:
    return json.dumps(
        {"consumer": "w", "host": "elsewhere", "pid": 4242, "ttl_s": 1, "beat_at_ms": beat_at_ms, **extra}
    )


def _ours(client, key: str) -> bool:
    raw = client.get(key)
    return raw is not None and json.loads(raw)["pid"] == os.getpid()


def _beating(client, key: str, interval_s: float, **holder):
    """Another worker's keeper: its first beat now, then one every ``interval_s`` until the returned stop is set."""
    stop = threading.Event()
    client.set(key, _other(int(time.time() * 1000), **holder), ex=30)

    def beat():
        while not stop.wait(interval_s):
            client.set(key, _other(int(time.time() * 1000), **holder), ex=30)

    thread = threading.Thread(target=beat)
    thread.start()
    return stop, thread


def test_a_free_name_is_taken_at_once(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=5)
    assert hb.claim(threading.Event()) == Claim(True, None)
    assert _ours(client, hb.key)
    assert 0 < client.ttl(hb.key) <= 5


@pytest.mark.parametrize(
    ("holder", "interval_s", "told_s"),
    [
        ({}, 0.05, 6.0),  # waits at most the larger TTL + 1 s; refused at the holder's next beat
        ({"ttl_s": None}, 2.5, 31.0),  # a worker from before ttl_s was written: the default TTL, not this one's 1 s
        ({"host": socket.gethostname(), "pid": os.getpid(), "ttl_s": 1}, 0.05, None),  # a twin container, same pid
    ],
    ids=["live", "live-without-ttl", "live-twin-same-host-and-pid"],
)
def test_a_name_another_process_keeps_beating_is_refused_and_left_to_it(client, key_prefix, holder, interval_s, told_s):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=5 if told_s == 6.0 else 1)
    stop, thread = _beating(client, hb.key, interval_s, **holder)
    try:
        waits = []
        with pytest.raises(NameInUse) as refused:
            hb.claim(threading.Event(), on_wait=lambda who, at_most_s: waits.append(at_most_s))
    finally:
        stop.set()
        thread.join()
    assert refused.value.holder["pid"] == holder.get("pid", 4242)
    if told_s is not None:
        assert waits == [told_s]  # told once how long it would wait at most
    assert "phase" not in json.loads(client.get(hb.key))  # the holder's beat: never overwritten by the claim


def test_a_dead_holders_key_is_waited_out_then_taken_over(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=1)
    client.set(hb.key, _other(1), px=1500)  # kill -9: nobody refreshes it
    waits = []
    claim = hb.claim(threading.Event(), on_wait=lambda holder, at_most_s: waits.append(holder["pid"]))
    assert claim.took and claim.previous["pid"] == 4242 and waits == [4242]
    assert _ours(client, hb.key)


def test_a_dead_key_of_this_host_and_pid_is_taken_once_its_next_beat_is_overdue(client, key_prefix):
    """A container's PID 1 restarted under the same hostname: no waiting for the key's TTL."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    last_beat_ms = int(time.time() * 1000) - 20_000  # 20 s ago: a beat every 10 s was due
    client.set(hb.key, _other(last_beat_ms, host=socket.gethostname(), pid=os.getpid(), ttl_s=30), ex=30)
    waits = []
    claim = hb.claim(threading.Event(), on_wait=lambda *a: waits.append(a))
    assert claim.took and claim.previous["pid"] == os.getpid()
    assert waits == [] and json.loads(client.get(hb.key))["beat_at_ms"] > last_beat_ms


@pytest.mark.parametrize("kind", ["string", "hash"])
def test_a_key_that_is_no_heartbeat_is_overwritten_at_once(client, key_prefix, kind):
    """No worker wrote it (each heartbeat names its host and pid): overwritten, as the keeper did before."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    if kind == "string":
        client.set(hb.key, "left here by hand")
    else:
        client.hset(hb.key, "a", "b")
    waits = []
    assert hb.claim(threading.Event(), on_wait=lambda *a: waits.append(a)) == Claim(True, {})
    assert waits == [] and _ours(client, hb.key) and client.ttl(hb.key) > 0


def test_a_stop_while_waiting_leaves_the_key_alone(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    client.set(hb.key, _other(1), ex=30)
    stop = threading.Event()
    claim = hb.claim(stop, on_wait=lambda *a: stop.set())
    assert not claim.took and claim.previous["pid"] == 4242
    assert json.loads(client.get(hb.key))["pid"] == 4242


def _taken_over(client, key_prefix) -> tuple[Heartbeat, Heartbeat]:
    """(frozen, newcomer): the first claimed the name, froze past its TTL (its key expired), the second took it."""
    frozen = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    assert frozen.claim(threading.Event()).took
    client.delete(frozen.key)  # what the TTL does to a frozen holder's key
    newcomer = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    assert newcomer.claim(threading.Event()) == Claim(True, None)
    return frozen, newcomer


def test_a_beat_after_the_name_was_taken_over_writes_nothing_and_names_the_holder(client, key_prefix):
    frozen, newcomer = _taken_over(client, key_prefix)
    holder = frozen.beat(phase="idle")
    assert holder is not None and holder["instance"] == newcomer.instance
    assert json.loads(client.get(newcomer.key))["instance"] == newcomer.instance
    assert newcomer.beat(phase="idle") is None  # the newcomer's own beats go on


def test_a_beat_writes_its_key_again_after_it_vanished(client, key_prefix):
    """Redis restarted empty, or a freeze nobody used: the name is still free, so the beat takes it again."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    assert hb.claim(threading.Event()).took
    client.delete(hb.key)
    assert hb.beat(phase="idle") is None
    assert json.loads(client.get(hb.key))["instance"] == hb.instance and 0 < client.ttl(hb.key) <= 30


def test_clear_at_exit_leaves_a_name_taken_over_to_its_new_holder(client, key_prefix):
    frozen, newcomer = _taken_over(client, key_prefix)
    assert frozen.clear() is False
    assert json.loads(client.get(newcomer.key))["instance"] == newcomer.instance
    assert newcomer.clear() is True and client.get(newcomer.key) is None


def _group_with_consumer(client, stream: str, consumer: str, pending: int) -> None:
    """A group in which ``consumer`` exists and holds ``pending`` entries read but not acked."""
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    client.xgroup_createconsumer(stream, "g", consumer)
    for i in range(pending):
        client.xadd(stream, {"id": f"t{i}", "text": "x"})
    if pending:
        client.xreadgroup("g", consumer, {stream: ">"}, count=pending)


def _consumers(client, stream: str) -> list[str]:
    return [c["name"].decode() for c in client.xinfo_consumers(stream, "g")]


def test_leaving_the_group_at_exit_removes_the_name_only_if_it_is_ours_and_holds_nothing(client, key_prefix):
    """One script: as three commands (GET, XPENDING, DELCONSUMER) a newcomer taking the name in between lost the
    entries it had just read, dropped with the consumer."""
    stream = key_prefix + "in"
    frozen, newcomer = _taken_over(client, key_prefix)
    _group_with_consumer(client, stream, "w", pending=0)
    assert frozen.leave_group(stream, "g", "w") is False and _consumers(client, stream) == ["w"]  # taken over
    client.xadd(stream, {"id": "t", "text": "x"})
    client.xreadgroup("g", "w", {stream: ">"}, count=1)
    assert newcomer.leave_group(stream, "g", "w") is False and _consumers(client, stream) == ["w"]  # it holds one
    assert client.xpending(stream, "g")["pending"] == 1
    (entry,) = client.xpending_range(stream, "g", "-", "+", 1)
    client.xack(stream, "g", entry["message_id"])
    assert newcomer.leave_group(stream, "g", "w") is True and _consumers(client, stream) == []
    client.delete(newcomer.key)  # expired, or a Redis restarted empty: nobody else holds the name
    _group_with_consumer(client, key_prefix + "in2", "w", pending=0)
    assert newcomer.leave_group(key_prefix + "in2", "g", "w") is True
    assert newcomer.leave_group(key_prefix + "none", "g", "w") is False  # no stream: nothing to leave


def test_a_takeover_replaces_only_the_beat_it_waited_out(client, key_prefix):
    """A holder that beat once more just before the takeover is alive: its new beat is not replaced."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    waited_out, latest = _other(1), _other(2)
    client.set(hb.key, latest, ex=30)
    state, value = heartbeat_script(client, [hb.key], [hb.instance, hb._value({}), 30, waited_out])
    assert (state, value) == (b"held", latest.encode()) and client.get(hb.key) == latest.encode()
    state, value = heartbeat_script(client, [hb.key], [hb.instance, hb._value({}), 30, latest])
    assert (state, value) == (b"written", latest.encode()) and _ours(client, hb.key)


def test_the_keeper_stops_beating_once_another_process_holds_the_name(client, key_prefix):
    """One call of ``on_lost`` with the holder; the holder's key is never overwritten by later beats."""
    frozen = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=1)  # a beat every 1/3 s
    assert frozen.claim(threading.Event()).took
    lost = []
    told = threading.Event()
    keeper = Keeper(
        frozen,
        Status(),
        refresh=None,
        refresh_interval_s=1.0,
        log=get_logger("test"),
        on_lost=lambda h: (lost.append(h), told.set()),
    )
    keeper.start()
    try:
        newcomer = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
        client.set(newcomer.key, newcomer._value({"phase": "idle"}), ex=30)  # took it while the other was frozen
        assert told.wait(10), "the keeper never noticed"
        time.sleep(1.0)  # three more beat intervals
    finally:
        keeper.stop()
    assert len(lost) == 1 and lost[0]["instance"] == newcomer.instance and keeper.lost == lost[0]
    assert json.loads(client.get(newcomer.key))["instance"] == newcomer.instance


def test_a_change_of_phase_reaches_the_heartbeat_before_the_next_regular_beat(client, key_prefix):
    """The key said "reading" for up to a third of the TTL after the worker moved on: ``status`` showed a phase that
    was over, its age growing. With a TTL of 600 s the regular beats are 200 s apart: only the change can beat."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=600)
    assert hb.claim(threading.Event()).took
    status = Status()
    keeper = Keeper(hb, status, refresh=None, refresh_interval_s=1.0, log=get_logger("test"))
    keeper.start()

    def phase_in_redis(want: str) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if json.loads(client.get(hb.key)).get("phase") == want:
                return True
            time.sleep(0.05)
        return False

    try:
        status.set_phase("reading")
        assert phase_in_redis("reading")
        status.pass_started()
        assert phase_in_redis("inferring")
        status.set_phase("writing")
        status.set_phase("reading")  # two changes at once: the beat carries the latest
        assert phase_in_redis("reading")
    finally:
        keeper.stop()


@pytest.mark.parametrize("request_args, code", [(("SIGTERM",), 0), (("consumer name lost", 2), 2)])
def test_a_stop_while_the_model_loads_stops_without_reading(redis_url, key_prefix, monkeypatch, request_args, code):
    """A SIGTERM during the load used to log warm_shutdown, then worker_ready, and read a window before stopping;
    the name lost meanwhile (the keeper's request, exit 2) must still exit 2."""
    from types import SimpleNamespace

    from worker.settings import Settings
    from worker.stream import startup

    made = []

    class Quiet(startup.Shutdown):
        def install(self) -> None:  # no real handlers in the test process
            made.append(self)

    def load_and_get_stopped(settings, log):
        made[0].request(*request_args)  # what the signal handler or the keeper does
        return SimpleNamespace(model_name="m")

    monkeypatch.setattr(startup, "Shutdown", Quiet)
    monkeypatch.setattr(startup, "_load_model", load_and_get_stopped)
    settings = Settings(
        redis_url=redis_url,
        input_stream=key_prefix + "in",
        results_stream=key_prefix + "results",
        dead_letter_stream=key_prefix + "dead",
        heartbeat_key_prefix=key_prefix + "hb:",
        consumer="load-stop",
    )
    assert startup.start(settings, drain=False) == code  # an exit code, not the started worker that would read
    client = redis.Redis.from_url(redis_url)
    assert client.get(key_prefix + "hb:load-stop") is None  # its own heartbeat cleared: no live-looking worker
