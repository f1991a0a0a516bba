"""Find a Redis for the demo, or start a throwaway ``redis-server`` and stop it afterwards.

Why: ``make demo`` should work on a laptop with nothing running, without ever
touching data in someone's real Redis beyond its own namespaced keys. The server
binary comes from PATH or from the ``embedded-redis`` extra (worker.redis_server).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from worker.redact import mask_secrets
from worker.redis_server import PrivateRedis, answers, redis_or_private, require_server_binary

__all__ = ["DEFAULT_URL", "answers", "demo_redis", "local_redis_server"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"


@contextlib.contextmanager
def local_redis_server(start_timeout_s: float = 10.0) -> Iterator[str]:
    """A private ``redis-server`` on a free loopback port, no persistence, in a temp dir; stopped on exit."""
    server = PrivateRedis(binary=require_server_binary()).start(timeout_s=start_timeout_s)
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def demo_redis(explicit_url: str | None, configured_url: str | None, log=print) -> Iterator[str]:
    """``explicit_url`` must answer; else the configured/default URL if it answers; else a private server. A URL
    that is no usable Redis URL is said so (a private server would hide the misconfiguration)."""
    from worker.preflight import redis_url_problem

    for url, var in ((explicit_url, "--redis-url"), (configured_url, "TRIAGE_REDIS_URL")):
        if url and (problem := redis_url_problem(url, var=var)) is not None:
            raise RuntimeError(str(problem))
    if explicit_url:
        if not answers(explicit_url):
            raise RuntimeError(f"no Redis answers at {mask_secrets(explicit_url)}")
        yield explicit_url
        return
    with redis_or_private(configured_url or DEFAULT_URL, log=log, purpose="this demo") as url:
        yield url
