"""keyspace.delete_under on a real Redis: a prefix with glob characters is matched literally."""

from __future__ import annotations

import pytest
import redis

from worker.keyspace import delete_under, keys_under


@pytest.mark.parametrize(
    ("prefix", "gone", "kept"),
    [
        ("[a]:", ["[a]:tickets"], ["a:tickets"]),  # a character class, were it a glob
        ("*:", ["*:x"], ["live:results"]),  # everything, were it a glob
        ("ns?", ["ns?1"], ["nsX", "ns1"]),
        ("back\\slash:", ["back\\slash:x"], ["backslash:x"]),
    ],
)
def test_delete_under_deletes_only_keys_that_start_with_the_prefix(redis_url, key_prefix, prefix, gone, kept):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    for name in gone + kept:
        client.set(key_prefix + name, "v")
    assert sorted(keys_under(client, key_prefix + prefix)) == sorted(key_prefix + g for g in gone)
    assert delete_under(client, key_prefix + prefix) == len(gone)
    assert [client.exists(key_prefix + k) for k in kept] == [1] * len(kept)
    assert not any(client.exists(key_prefix + g) for g in gone)
