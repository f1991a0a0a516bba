"""``status`` and ``healthcheck`` after Redis lost the worker's keys (FLUSHALL, a Redis restarted without its data).

The reader meets NOGROUP within its next read and recreates the group at once, but the heartbeat key came back only
with the keeper's next scheduled beat, up to a third of TRIAGE_HEARTBEAT_TTL_S later (10 s by default): meanwhile
``status`` showed no worker and ``healthcheck --ready`` failed the readiness probe of a healthy pod. The recovery now
beats at once. A private Redis: FLUSHALL is never sent to the shared one.
"""

from __future__ import annotations

import json
import time

import pytest
import redis

from tests.worker_proc import make_env, run_cli, start_worker
from worker.redis_server import PrivateRedis, find_server_binary

TTL_S = 600  # the keeper's own next beat comes 200 s after the last: long after every wait below


def _wait_for(what: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.1)


def test_status_and_healthcheck_show_the_worker_again_as_soon_as_it_recreates_its_group(tiny_model_dir, tmp_path):
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server for a private Redis (FLUSHALL)")
    with PrivateRedis(binary=binary) as server:
        env = make_env(
            tiny_model_dir,
            server.url,
            "flush:",
            tmp_path / "cache",
            TRIAGE_CONSUMER="flush-a",
            TRIAGE_HEARTBEAT_TTL_S=TTL_S,
        )
        client = redis.Redis.from_url(server.url)
        beat = env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + "flush-a"
        with start_worker(env) as w:
            assert client.exists(beat)  # written at start-up (phase "starting"); the keeper's next beat: in 200 s
            client.flushall()
            w.wait_for("group_recreated", timeout_s=60)
            _wait_for("heartbeat key", lambda: client.exists(beat))
            snap = json.loads(run_cli(env, "status", "--json").stdout)
            assert [(x["consumer"], x["state"]) for x in snap["workers"]] == [("flush-a", "alive")], snap["workers"]
            assert snap["queue"]["exists"], snap["queue"]
            ready = run_cli(env, "healthcheck", "--ready", "--consumer", "flush-a")
            assert ready.returncode == 0, ready.stderr
            assert w.stop() == 0, w.stderr_tail()


def test_healthcheck_ready_passes_as_soon_as_the_worker_takes_work(triage_env):
    """The heartbeat said "starting" until the keeper's next beat, a third of the TTL after the model loaded (200 s
    here, 10 s by default): the readiness probe failed a worker that was already taking work. Leaving "starting"
    beats at once."""
    env = {**triage_env, "TRIAGE_CONSUMER": "ready-a", "TRIAGE_HEARTBEAT_TTL_S": str(TTL_S)}
    with start_worker(env) as w:  # returns at "worker_ready"
        _wait_for(
            "healthcheck --ready passing",
            lambda: run_cli(env, "healthcheck", "--ready", "--consumer", "ready-a").returncode == 0,
            timeout_s=30,
        )
        assert w.stop() == 0, w.stderr_tail()
