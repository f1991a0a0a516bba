"""Find a Redis for the demo, or start a throwaway ``redis-server`` and stop it afterwards.

Why: ``make demo`` should work on a laptop with nothing running, without ever
touching data in someone's real Redis beyond its own namespaced keys.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Iterator

import redis

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def answers(url: str, timeout_s: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_redis_server(start_timeout_s: float = 10.0) -> Iterator[str]:
    """A private ``redis-server`` on a free loopback port, no persistence, in a temp dir; stopped on exit."""
    exe = shutil.which("redis-server")
    if not exe:
        raise RuntimeError(
            "no Redis answers and redis-server is not installed: install it (apt-get install redis-server, "
            "brew install redis) or start one (docker compose up -d redis), or set TRIAGE_REDIS_URL"
        )
    with tempfile.TemporaryDirectory(prefix="triage-redis-") as tmp:
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + start_timeout_s
            while not answers(url, 0.2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port} (exit code {proc.poll()})")
                time.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def demo_redis(explicit_url: str | None, configured_url: str | None, log=print) -> Iterator[str]:
    """``explicit_url`` must answer; else the configured/default URL if it answers; else a private server."""
    if explicit_url:
        if not answers(explicit_url):
            raise RuntimeError(f"no Redis answers at {explicit_url}")
        yield explicit_url
        return
    url = configured_url or DEFAULT_URL
    if answers(url):
        yield url
        return
    log(f"no Redis at {url}; starting a private redis-server for this demo")
    with local_redis_server() as private:
        yield private
