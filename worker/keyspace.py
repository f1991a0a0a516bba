"""Keys under a prefix, found with SCAN and matched literally.

A namespace a user chose (``triage-producer demo --namespace``) must not act as a glob: ``triage`` alone, or
``a[1]:``, would otherwise reach keys that are not under it, and a cleanup would delete them.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis


def glob_escape(s: str) -> str:
    """``s`` as a literal in a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def keys_under(client: redis.Redis, prefix: str, count: int = 1000) -> Iterator:
    """Every key that starts with ``prefix`` (as SCAN returns them: bytes or str)."""
    return client.scan_iter(match=glob_escape(prefix) + "*", count=count)


def delete_under(client: redis.Redis, prefix: str) -> int:
    """Delete every key that starts with ``prefix`` (and nothing else); how many there were."""
    keys = list(keys_under(client, prefix))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])
    return len(keys)
