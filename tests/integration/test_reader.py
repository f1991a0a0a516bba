"""worker.stream.reader.Reader on a real Redis: where it resumes reading after the group was recreated."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import redis

from worker.stream.group import GroupGuard
from worker.stream.reader import Reader
from worker.stream.sizing import WindowSizer
from worker.stream.source import StreamSource

QUIET = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None, exception=lambda *a, **k: None)


def test_a_group_recreated_during_a_read_of_our_pending_entries_is_read_from_the_start_again(redis_url, key_prefix):
    """The reset comes from another thread (the writer or keeper met NOGROUP) while the reader waits for Redis; the
    read's own cursor must not overwrite it, or the new group's entries pending on us wait for a claim (60 s)."""
    client = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    for i in range(3):
        client.xadd(stream, {"id": f"r-{i}", "text": "hello"})
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    guard = GroupGuard(source, QUIET)
    reader = Reader(
        source,
        lambda texts: texts,
        plan=lambda prepared: [],
        guard=guard,
        sizer=WindowSizer(0, 16),
        max_wait_ms=0,
        claim_idle_ms=60_000,
        max_deliveries=5,
        max_text_bytes=10_000,
        reconnect_max_s=1.0,
        stop=threading.Event(),
        log=QUIET,
    )
    client.xreadgroup("triage", "reader-test", {stream: ">"}, count=3)  # delivered to us, not acked
    read = source.read_own_pending

    def recreated_meanwhile(after_id, count):
        got = read(after_id, count)
        guard.epoch += 1  # what GroupGuard.recover does on the other thread, listeners included
        reader._group_recreated()
        return got

    source.read_own_pending = recreated_meanwhile
    reader._epoch = guard.epoch
    reader.cap_items = 16
    where, got = reader._read()
    assert where == "pending" and len(got) == 3
    assert reader._pending_cursor == "0" and reader._claim_cursor == "0-0"  # the reset stands: read again from 0
    source.read_own_pending = read
    reader._epoch = guard.epoch
    reader._read()  # the next read, in the same epoch, pages on from what it read
    assert reader._pending_cursor != "0"
