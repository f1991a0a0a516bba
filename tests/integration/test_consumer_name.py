"""Heartbeat.claim on a real Redis: one live process per consumer name (as rq refuses a live worker's name).

Two processes under one TRIAGE_CONSUMER re-read each other's pending entries (duplicates, delivery counts pushed
towards TRIAGE_MAX_DELIVERIES), so the second is refused while the first keeps beating; a dead holder's key is
waited out, never blocking a restart for longer than the heartbeat's TTL."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest
import redis

from worker.stream.health import Heartbeat, NameInUse


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


def test_a_free_name_is_taken_at_once(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=5)
    assert hb.claim(threading.Event()) is None
    assert _ours(client, hb.key)
    assert 0 < client.ttl(hb.key) <= 5


def test_a_name_another_process_keeps_beating_is_refused_and_left_to_it(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=5)
    stop = threading.Event()

    client.set(hb.key, _other(0), ex=5)  # the other worker is up before this one starts

    def beat():  # its keeper
        n = 0
        while not stop.wait(0.05):
            n += 1
            client.set(hb.key, _other(n), ex=5)

    other = threading.Thread(target=beat)
    other.start()
    try:
        waits = []
        with pytest.raises(NameInUse) as refused:
            hb.claim(threading.Event(), on_wait=lambda holder, at_most_s: waits.append((holder["pid"], at_most_s)))
    finally:
        stop.set()
        other.join()
    assert refused.value.holder["pid"] == 4242 and refused.value.holder["host"] == "elsewhere"
    assert waits == [(4242, 6.0)]  # told once how long it would wait at most: the larger TTL + 1 s
    assert not _ours(client, hb.key)


def test_a_dead_holders_key_is_waited_out_then_taken_over(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=1)
    client.set(hb.key, _other(1), px=700)  # kill -9: nobody refreshes it
    waits = []
    taken = hb.claim(threading.Event(), on_wait=lambda holder, at_most_s: waits.append(holder["pid"]))
    assert taken["pid"] == 4242 and waits == [4242]
    assert _ours(client, hb.key)


def test_a_key_of_this_host_and_pid_is_taken_at_once(client, key_prefix):
    """A container's PID 1 restarted under the same hostname: the name is its own."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    client.set(hb.key, _other(1, host=socket.gethostname(), pid=os.getpid()), ex=30)
    waits = []
    assert hb.claim(threading.Event(), on_wait=lambda *a: waits.append(a))["pid"] == os.getpid()
    assert waits == [] and _ours(client, hb.key)


def test_a_key_that_is_no_heartbeat_is_overwritten_after_one_ttl(client, key_prefix):
    """No expiry and no change within the TTL: no worker wrote it (each beat has a TTL); overwritten, as before."""
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=1)
    client.set(hb.key, "left here by hand")
    assert hb.claim(threading.Event()) == {}
    assert _ours(client, hb.key) and client.ttl(hb.key) > 0


def test_a_stop_while_waiting_leaves_the_key_alone(client, key_prefix):
    hb = Heartbeat(client, key_prefix + "hb:", "w", ttl_s=30)
    client.set(hb.key, _other(1), ex=30)
    stop = threading.Event()
    assert hb.claim(stop, on_wait=lambda *a: stop.set()) is None
    assert json.loads(client.get(hb.key))["pid"] == 4242
