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


def _reader(source: StreamSource, *, cap_items: int = 16, **extra) -> Reader:
    reader = Reader(
        source,
        lambda texts: texts,
        plan=lambda prepared: [],
        guard=GroupGuard(source, QUIET),
        sizer=WindowSizer(0, cap_items),
        max_wait_ms=0,
        claim_idle_ms=60_000,
        max_deliveries=5,
        max_text_bytes=10_000,
        reconnect_max_s=1.0,
        stop=threading.Event(),
        log=QUIET,
        drain=True,  # short blocking reads of new entries
        **extra,
    )
    reader.cap_items = cap_items
    return reader


def _deliveries(client: redis.Redis, stream: str, consumer: str) -> dict[str, int]:
    rows = client.xpending_range(stream, "triage", min="-", max="+", count=100, consumername=consumer)
    return {r["message_id"].decode(): int(r["times_delivered"]) for r in rows}


def test_re_reading_our_pending_entries_after_read_errors_counts_no_delivery_for_entries_still_in_hand(
    redis_url, key_prefix
):
    """Every read error makes the reader re-read its own pending entries (a lost reply may have delivered some it
    never saw). The entries of the window in hand must not count as delivered again each time, or a few Redis blips
    during one long window dead-letter healthy tickets as poison (TRIAGE_MAX_DELIVERIES=5)."""
    client = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    in_hand = [client.xadd(stream, {"id": f"h-{i}", "text": "hello"}).decode() for i in range(4)]
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    reader = _reader(source)
    reader._epoch = reader.guard.epoch
    reader._pending_cursor = None  # the start's own re-read is done: this window is new entries
    where, got = reader._read()
    assert where == "new" and [e.stream_id for e in got] == in_hand
    unseen = [client.xadd(stream, {"id": f"u-{i}", "text": "hello"}).decode() for i in range(2)]
    client.xreadgroup("triage", "reader-test", {stream: ">"}, count=2)  # a reply lost on the way: ours, never seen

    handed = []
    for _ in range(6):  # six read errors while the window is in hand
        reader._pending_cursor = "0"  # what _on_read_error does
        where, got = reader._read()
        if where == "pending":
            handed += [(e.stream_id, e.deliveries) for e in got]
    assert handed == [(i, 2) for i in unseen]  # the unseen ones once, as their second delivery
    counts = _deliveries(client, stream, "reader-test")
    assert {i: counts[i] for i in in_hand} == dict.fromkeys(in_hand, 1)
    assert {i: counts[i] for i in unseen} == dict.fromkeys(unseen, 2)

    restarted = _reader(source)  # a new process holds nothing: every pending entry is delivered again, counted
    restarted._epoch = restarted.guard.epoch
    where, got = restarted._read()
    assert where == "pending"
    assert [(e.stream_id, e.deliveries) for e in got] == [(i, 2) for i in in_hand] + [(i, 3) for i in unseen]
    assert _deliveries(client, stream, "reader-test") == {**dict.fromkeys(in_hand, 2), **dict.fromkeys(unseen, 3)}


def test_our_pending_entries_are_read_page_by_page_skipping_held_ones_and_deleted_ones_come_without_fields(
    redis_url, key_prefix
):
    client = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    ids = [client.xadd(stream, {"id": f"p-{i}", "text": f"hello {i}"}).decode() for i in range(6)]
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    client.xreadgroup("triage", "reader-test", {stream: ">"}, count=6)
    client.xdel(stream, ids[4])
    held = [ids[1], ids[3]]
    pages, cursor = [], "0"
    while cursor is not None:
        got, cursor = source.read_own_pending(cursor, 2, held)
        pages.append([(e.stream_id, e.fields and e.fields[b"text"].decode(), e.deliveries) for e in got])
    assert pages == [
        [(ids[0], "hello 0", 2)],
        [(ids[2], "hello 2", 2)],
        [(ids[4], None, 1), (ids[5], "hello 5", 2)],  # deleted: no fields, left pending for its dead letter
        [],
    ]
    counts = _deliveries(client, stream, "reader-test")
    assert counts == {ids[0]: 2, ids[1]: 1, ids[2]: 2, ids[3]: 1, ids[4]: 1, ids[5]: 2}


def test_another_consumers_pending_entries_deleted_from_the_stream_are_dead_lettered_when_claimed(
    redis_url, key_prefix
):
    """XAUTOCLAIM drops deleted entries from the pending list: they vanished with a warning, and a waiter on their
    tickets waited forever (the same entries met by their own consumer's restart were dead-lettered)."""
    from worker.stream.messages import DELETED_REASON
    from worker.stream.sink import ResultSink

    client = redis.Redis.from_url(redis_url)
    stream, dead = key_prefix + "tickets", key_prefix + "dead"
    ids = [client.xadd(stream, {"id": f"g-{i}", "text": "hello"}).decode() for i in range(3)]
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    client.xreadgroup("triage", "ghost", {stream: ">"}, count=3)  # a consumer that died holding them
    client.xdel(stream, ids[1])
    orphans = ResultSink(
        client,
        input_stream=stream,
        group="triage",
        results_stream=key_prefix + "results",
        dead_letter_stream=dead,
        result_key_prefix=key_prefix + "result:",
        result_ttl_s=60,
        results_maxlen=1000,
        dead_letter_maxlen=1000,
    )
    reader = _reader(source, orphans=orphans)
    reader.claim_idle_ms = 0
    reader._epoch = reader.guard.epoch
    where, got = reader._read()
    assert where == "claimed" and [e.stream_id for e in got] == [ids[0], ids[2]]
    (letter,) = [f for _, f in client.xrange(dead)]
    assert letter[b"stream_id"].decode() == ids[1] and letter[b"reason"].decode() == DELETED_REASON
    assert letter[b"worker"] == b"reader-test"


def test_a_group_recreated_during_a_read_of_our_pending_entries_is_read_from_the_start_again(redis_url, key_prefix):
    """The reset comes from another thread (the writer or keeper met NOGROUP) while the reader waits for Redis; the
    read's own cursor must not overwrite it, or the new group's entries pending on us wait for a claim (60 s)."""
    client = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    for i in range(3):
        client.xadd(stream, {"id": f"r-{i}", "text": "hello"})
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    reader = _reader(source)
    guard = reader.guard
    client.xreadgroup("triage", "reader-test", {stream: ">"}, count=3)  # delivered to us, not acked
    read = source.read_own_pending

    def recreated_meanwhile(after_id, count, held=(), **limits):
        got = read(after_id, count, held, **limits)
        guard.epoch += 1  # what GroupGuard.recover does on the other thread, listeners included
        reader._group_recreated()
        return got

    source.read_own_pending = recreated_meanwhile
    reader._epoch = guard.epoch
    where, got = reader._read()
    assert where == "pending" and len(got) == 3
    assert reader._pending_cursor == "0" and reader._claim_cursor == "0-0"  # the reset stands: read again from 0
    source.read_own_pending = read
    reader._epoch = guard.epoch
    reader._read()  # the next read, in the same epoch, pages on from what it read
    assert reader._pending_cursor != "0"


def test_entries_in_hand_delivered_again_as_new_start_a_new_epoch_and_are_read_again(redis_url, key_prefix):
    """Another worker recreated the group (or an operator did, or Redis came back from an older snapshot) while a
    window of ours was in flight, and this process met no NOGROUP. The new group delivers that window's ids to us
    as new. They were skipped as in hand; the window's passes written before that re-delivery found them not ours;
    so they ended pending on us in no window until a claim took them, TRIAGE_CLAIM_IDLE_MS later. Now the guard
    moves to a new epoch (the window is dropped) and our pending entries are read again at once."""
    client = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    ids = [client.xadd(stream, {"id": f"w-{i}", "text": "hello"}).decode() for i in range(4)]
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    reader = _reader(source)
    guard = reader.guard
    reader._epoch, reader._pending_cursor = guard.epoch, None
    where, window = reader._read()
    assert where == "new" and [e.stream_id for e in window] == ids  # the window in flight
    client.xgroup_destroy(stream, "triage")  # recreated by someone else, at the recovery point (here: 0)
    client.xgroup_create(stream, "triage", id="0")
    reader._epoch = guard.epoch
    where, got = reader._read()  # the new group hands the window's ids to us as new
    assert got == [] and guard.epoch == 1 and reader._pending_cursor == "0"
    reader.settled(SimpleNamespace(ids=ids, epoch=0))  # the loop drops the window of the old epoch
    reader._epoch = guard.epoch
    where, got = reader._read()
    assert where == "pending" and [e.stream_id for e in got] == ids  # read again now, not a claim 60 s later


def test_an_entry_that_gives_a_field_twice_is_dead_lettered_with_its_fields_as_sent(redis_url, key_prefix):
    """redis-py reads an entry into a dict: of `text "good text" text ""` only the last stayed, so the ticket was
    dead-lettered as "text is empty", with a payload size and hash that were not the entry's."""
    import hashlib
    import json

    from worker.stream.messages import Rejected, parse_entry
    from worker.stream.records import dead_letter_fields

    client = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    raw = [b"id", b"D-1", b"text", b"good text", b"text", b""]
    source = StreamSource(client, stream, "triage", "reader-test")
    source.ensure_group()
    client.execute_command("XADD", stream, "*", *raw)
    (entry,) = source.read_new(10, None)
    got = parse_entry(entry.stream_id, entry.fields, max_text_bytes=1000)
    assert isinstance(got, Rejected) and got.ticket_id == "D-1", got
    assert got.reason == "the entry gives 'text' more than once"
    letter = dead_letter_fields(stream_id=entry.stream_id, reason=got.reason, payload=entry.fields, deliveries=1)
    recipe = hashlib.sha256(b"".join(b"%d:%s," % (len(p), p) for p in raw)).hexdigest()  # docs/worker.md's
    assert letter["payload_sha256"] == recipe and letter["payload_bytes"] == str(sum(map(len, raw)))
    assert json.loads(letter["payload"]) == {"id": "D-1", "text": "good text", "text#2": ""}
    # a claim and a re-read of our own pending entries read it the same way
    claimed, _, _ = StreamSource(client, stream, "triage", "other").autoclaim("0-0", 10, 0)
    assert claimed[0].fields.repeated() == ["text"]
    (own,), _ = StreamSource(client, stream, "triage", "other").read_own_pending("0", 10)
    assert own.fields.repeated() == ["text"] and own.deliveries == 3
