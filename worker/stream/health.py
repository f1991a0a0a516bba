"""Liveness as a Redis key with a TTL: present = the loop ran within the last TTL seconds.

A key that expires on its own needs no cleanup after a kill -9, and any
process that can reach Redis (``triage-worker healthcheck``, a dashboard,
redis-cli) can check it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Iterator

import redis


class Heartbeat:
    def __init__(self, client: redis.Redis, key_prefix: str, consumer: str, ttl_s: int, info: dict | None = None):
        self.client = client
        self.key = key_prefix + consumer
        self.ttl_s = ttl_s
        self.info = {"consumer": consumer, "host": socket.gethostname(), "pid": os.getpid(), **(info or {})}
        self.started_at_ms = int(time.time() * 1000)
        self._last_beat_s = float("-inf")

    def beat(self, **status) -> None:
        now = time.time()
        value = {**self.info, "started_at_ms": self.started_at_ms, "beat_at_ms": int(now * 1000), **status}
        self.client.set(self.key, json.dumps(value), ex=self.ttl_s)
        self._last_beat_s = time.monotonic()

    def maybe_beat(self, **status) -> bool:
        """Refresh at a third of the TTL, so two missed refreshes still leave the key alive."""
        if time.monotonic() - self._last_beat_s < self.ttl_s / 3.0:
            return False
        self.beat(**status)
        return True

    def clear(self) -> None:
        self.client.delete(self.key)


def fresh_heartbeats(client: redis.Redis, key_prefix: str, consumer: str | None = None) -> Iterator[tuple[str, dict]]:
    """(consumer, heartbeat JSON) for each live heartbeat (one consumer's if given)."""
    keys = [key_prefix + consumer] if consumer else client.scan_iter(match=_glob_escape(key_prefix) + "*", count=500)
    for key in keys:
        raw = client.get(key)
        if raw is None:
            continue
        name = (key.decode() if isinstance(key, bytes) else key)[len(key_prefix) :]
        try:
            value = json.loads(raw)
        except ValueError:
            value = {"raw": raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw}
        yield name, value


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
