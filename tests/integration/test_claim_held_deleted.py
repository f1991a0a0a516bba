"""A ticket this process holds in a window, deleted from the stream (XDEL) while the window runs, and idle past the
claim idle time (the keeper's refresh leaves deleted entries alone), met by this process's own claim sweep.

Before: the claim took it as another consumer's orphan. On Redis 7.0 its ``XCLAIM`` dropped it from the pending list
(the window's result was then skipped, the deleted dead letter written instead); on Redis 6.2 ``XCLAIM`` keeps it on
this consumer, so a window settle landing between the claim script and the reader's dead letter of it (a write with
no ownership check) still found it ours and wrote its record too: two records for one entry (a result and a dead
letter, or two dead letters). Now the claim leaves an entry pending on this consumer and held by this process to its
window, whose settle writes its one record; only deleted entries nobody here holds are dead-lettered by the claim.
Run on Redis 6.2.14 (TRIAGE_TEST_REDIS_URL) and 7.0."""

from __future__ import annotations

import redis

from tests.integration.test_reader import _reader
from tests.integration.test_sink import _sink as sink_under
from worker.stream.messages import DELETED_REASON
from worker.stream.sink import Outcome, ResultSink
from worker.stream.source import StreamSource

CONSUMER = "holder"


def _sink(client: redis.Redis, prefix: str, consumer: str | None) -> ResultSink:
    return sink_under(client, prefix, stream="tickets", group="triage", consumer=consumer)


def _records(client: redis.Redis, prefix: str) -> dict[str, list[tuple[str, str]]]:
    """Every record written, by input entry id: [(kind, label or reason), ...]."""
    out: dict[str, list[tuple[str, str]]] = {}
    for kind, key, what in (("result", "results", b"label"), ("dead", "dead", b"reason")):
        for _, f in client.xrange(prefix + key):
            out.setdefault(f[b"stream_id"].decode(), []).append((kind, f[what].decode()))
    return out


def _held_window(client: redis.Redis, prefix: str, n: int = 3):
    """A reader holding a window of ``n`` new entries, its source, the window's (ownership-checked) sink."""
    stream = prefix + "tickets"
    ids = [client.xadd(stream, {"id": f"t-{i}", "text": f"hello {i}"}).decode() for i in range(n)]
    source = StreamSource(client, stream, "triage", CONSUMER)
    source.ensure_group()
    reader = _reader(source, orphans=_sink(client, prefix, None))
    reader._epoch = reader.guard.epoch
    reader._pending_cursor = None  # the start's own re-read is done
    where, got = reader._read()
    assert where == "new" and [e.stream_id for e in got] == ids
    return ids, source, reader, _sink(client, prefix, CONSUMER)


def _window_outcome(ids: list[str]) -> Outcome:
    return Outcome(results=[{"stream_id": i, "label": "billing"} for i in ids], ack_ids=list(ids))


def test_a_held_entry_deleted_mid_window_gets_one_record_when_its_settle_meets_our_own_claim(redis_url, key_prefix):
    client = redis.Redis.from_url(redis_url)
    ids, source, reader, window_sink = _held_window(client, key_prefix)
    client.xdel(key_prefix + "tickets", ids[1])
    reader.claim_idle_ms, reader._next_claim_s = 0, 0.0  # the window outlasted the claim idle time (ids[1]: not
    # refreshed, deleted) and a claim sweep is due
    claim = source.autoclaim

    def settled_meanwhile(*args, **kw):  # the writer thread's settle, between the claim and its dead letters
        got = claim(*args, **kw)
        window_sink.write(_window_outcome(ids))
        return got

    source.autoclaim = settled_meanwhile
    reader._read()
    records = _records(client, key_prefix)
    assert {i: len(r) for i, r in records.items()} == dict.fromkeys(ids, 1), records  # 6.2 before: 2 for ids[1]
    assert records == {i: [("result", "billing")] for i in ids}, records  # 7.0 before: the deleted dead letter
    assert client.xpending(key_prefix + "tickets", "triage")["pending"] == 0


def test_a_held_entry_deleted_mid_window_gets_one_record_when_our_own_claim_comes_first(redis_url, key_prefix):
    client = redis.Redis.from_url(redis_url)
    ids, source, reader, window_sink = _held_window(client, key_prefix)
    client.xdel(key_prefix + "tickets", ids[1])
    reader.claim_idle_ms, reader._next_claim_s = 0, 0.0
    reader._read()  # the claim sweep while the window runs
    window_sink.write(_window_outcome(ids))  # then the window's settle
    records = _records(client, key_prefix)
    assert records == {i: [("result", "billing")] for i in ids}, records  # before: the "deleted" dead letter
    assert client.xpending(key_prefix + "tickets", "triage")["pending"] == 0


def test_our_own_deleted_pending_entry_no_window_holds_is_still_dead_lettered_by_the_claim(redis_url, key_prefix):
    """Only held entries are left to their window: one pending on this consumer that no window holds (a dead letter
    of it that failed on 6.2, a window dropped) is an orphan, dead-lettered by the next claim."""
    client = redis.Redis.from_url(redis_url)
    ids, source, reader, window_sink = _held_window(client, key_prefix)
    client.xdel(key_prefix + "tickets", ids[1])
    reader.in_flight.discard([ids[1]], reader._epoch)  # held no more, still pending on us
    window_sink.write(_window_outcome([ids[0], ids[2]]))
    reader.in_flight.discard(ids, reader._epoch)
    reader.claim_idle_ms, reader._next_claim_s = 0, 0.0
    reader._read()
    records = _records(client, key_prefix)
    assert records[ids[1]] == [("dead", DELETED_REASON)], records
    assert client.xpending(key_prefix + "tickets", "triage")["pending"] == 0
