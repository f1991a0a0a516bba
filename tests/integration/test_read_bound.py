"""Reads have a byte bound (TRIAGE_READ_MAX_BYTES) and an entry too large to be a ticket is never read whole.

Before: a window read COUNT entries whatever their size, so a producer that XADDed a few hundred entries of
10-100 MB made one reply many GB; the worker ran out of memory, restarted, re-read the same pending entries and
ran out again. Real Redis, real worker processes (tiny model); the big entries are 20 MB each. Measured on a
2-core box: the worker's peak RSS grew 306 MB (six new ones) and 114 MB (three claimed) before, 0.2 MB now.
"""

from __future__ import annotations

import json
import os

import pytest
import redis

from tests.worker_proc import env_with, start_worker, wait_settled
from worker.stream.messages import Unread, entry_max_bytes
from worker.stream.records import dead_letter_fields
from worker.stream.source import ReadLimits, StreamSource

BIG = 20_000_000
MAX_TEXT = 3000  # entry_max_bytes: 10,096
GROUP = "triage"


def _rss_kb(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def _reset_peak_rss(pid: int) -> int:
    """Reset the process's peak RSS (VmHWM) to its RSS now (Linux: ``clear_refs`` 5); that RSS in kB."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return _rss_kb(pid, "VmRSS")


def _big(i: int) -> dict:
    return {"id": f"big-{i}", "text": "x" * BIG, "channel": "mail"}


def _check_unread_letter(r: redis.Redis, env: dict, rec: dict, ticket_id: str, deliveries: str) -> None:
    """The dead letter of a 20 MB entry: the size reason, the size Redis measured, an excerpt, no hash; the
    latest-result key of its ticket id says so (a waiter learns the outcome), both a few kB."""
    assert rec["id"] == ticket_id and rec["deliveries"] == deliveries, rec
    assert rec["reason"].startswith(f"text is {BIG} bytes, over the limit of {MAX_TEXT} bytes"), rec["reason"]
    assert "too large to read" in rec["reason"] and "no SHA-256" in rec["reason"], rec["reason"]
    assert rec["payload_bytes"] == str(len("id" + ticket_id + "text" + "channel" + "mail") + BIG)
    assert rec["payload_sha256"] == "" and rec["payload_truncated"] == "1"
    excerpt = json.loads(rec["payload"])
    assert len(rec["payload"].encode()) <= 4096 and excerpt["text"].startswith("xxx") and excerpt["text"][-1] == "…"
    assert excerpt["id"] == ticket_id and excerpt["channel"] == "mail"
    assert sum(len(k) + len(v) for k, v in rec.items()) < 8192
    key = env["TRIAGE_RESULT_KEY_PREFIX"] + ticket_id
    assert json.loads(r.get(key)) == {"status": "dead_letter", **rec} and r.strlen(key) < 8192


needs_peak_rss = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="peak RSS is read and reset through Linux's /proc"
)


@pytest.fixture
def env(triage_env):
    return env_with(
        triage_env,
        TRIAGE_MAX_TEXT_BYTES=MAX_TEXT,
        TRIAGE_READ_MAX_BYTES=65_536,
        TRIAGE_WINDOW_MAX_ITEMS=16,
        TRIAGE_PASS_MAX_ITEMS=16,
        TRIAGE_MAX_INPUT_TOKENS=32,
        TRIAGE_CLAIM_IDLE_MS=200,
    )


@needs_peak_rss
def test_big_new_entries_are_dead_lettered_unread_and_their_neighbours_classified(env, redis_url):
    """Six 20 MB entries among eleven tickets, all added at once (one window could take them all): the worker's
    peak RSS grows by less than one of them, each gets its dead letter, every ticket its label."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    stream = env["TRIAGE_INPUT_STREAM"]
    with start_worker(env) as w:
        base_kb = _reset_peak_rss(w.pid)
        pipe = r.pipeline(transaction=True)  # appear together: the old worker read them in one reply
        for i in range(17):
            if i % 3 == 1:
                pipe.xadd(stream, _big(i))
            else:
                pipe.xadd(stream, {"id": f"ok-{i}", "text": f"I was charged twice, invoice {i}"})
        ids = pipe.execute()
        settled = wait_settled(r, env, ids, timeout_s=90)
        peak_kb = _rss_kb(w.pid, "VmHWM")
        assert w.stop() == 0, w.stderr_tail()
    growth_mb = (peak_kb - base_kb) / 1024
    assert growth_mb < BIG / 2**20, f"peak RSS grew {growth_mb:.0f} MB while 6 entries of 20 MB were read"
    for i, sid in enumerate(ids):
        kind, rec = settled[sid]
        if i % 3 == 1:
            assert kind == "dead", rec
            _check_unread_letter(r, env, rec, f"big-{i}", "1")
        else:
            assert kind == "result" and rec["id"] == f"ok-{i}", rec
    assert r.xpending(stream, GROUP)["pending"] == 0
    stopped = w.events("worker_stopped")[-1]
    assert (stopped["items"], stopped["dead_lettered"]) == (11, 6), stopped


@needs_peak_rss
def test_big_entries_pending_on_a_dead_worker_are_dead_lettered_unread_on_restart_and_when_claimed(env, redis_url):
    """The crash loop: the worker that read them died (out of memory) holding them. Restarted under its name it
    re-reads its own pending entries, and another name claims a dead consumer's: each big one is dead-lettered
    from its measure (one delivery more), each ticket classified once; the peak RSS of the claim stays low."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    stream = env["TRIAGE_INPUT_STREAM"]
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    own = [r.xadd(stream, f) for f in (_big(0), {"id": "own-1", "text": "my parcel never came"}, _big(2))]
    r.xreadgroup(GROUP, "restarted", {stream: ">"})  # delivered to the worker that died
    with start_worker(env_with(env, TRIAGE_CONSUMER="restarted")) as w:
        settled = wait_settled(r, env, own, timeout_s=60)
        base_kb = _reset_peak_rss(w.pid)
        pipe = r.pipeline(transaction=True)  # read by a consumer that dies, before the live worker could read them
        for i in range(5):
            pipe.xadd(stream, _big(10 + i) if i % 2 == 0 else {"id": f"ghost-{i}", "text": "refund me"})
        pipe.xreadgroup(GROUP, "ghost", {stream: ">"}, count=5)
        claimed = pipe.execute()[:5]
        settled.update(wait_settled(r, env, claimed, timeout_s=60))
        peak_kb = _rss_kb(w.pid, "VmHWM")
        assert w.stop() == 0, w.stderr_tail()
    growth_mb = (peak_kb - base_kb) / 1024
    assert growth_mb < BIG / 2**20, f"peak RSS grew {growth_mb:.0f} MB while 3 claimed entries of 20 MB were read"
    _check_unread_letter(r, env, settled[own[0]][1], "big-0", "2")
    _check_unread_letter(r, env, settled[own[2]][1], "big-2", "2")
    assert settled[own[1]][0] == "result"
    for i, sid in enumerate(claimed):
        kind, rec = settled[sid]
        if i % 2 == 0:
            _check_unread_letter(r, env, rec, f"big-{10 + i}", "2")
        else:
            assert kind == "result" and rec["id"] == f"ghost-{i}", rec
    assert w.events("entries_claimed") and r.xpending(stream, GROUP)["pending"] == 0


def test_each_read_stops_at_its_byte_budget_and_pages_on_without_losing_an_entry(redis_url, key_prefix):
    """Reads of new, own pending and claimed entries: each brings at most the budget plus one entry, an entry over
    entry_max_bytes only as its measure (the reply holds none of its values past the excerpt), every entry exactly
    once over the pages, delivery counts as XREADGROUP and XAUTOCLAIM count them."""
    r = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    limits = ReadLimits(max_text_bytes=1000, excerpt_bytes=256, max_bytes=4000)
    assert limits.entry_max_bytes == entry_max_bytes(1000) == 6096
    fields = [{b"id": b"n-%d" % i, b"text": b"t" * 900} for i in range(12)]  # 909 or 910 bytes
    fields[5] = {b"id": b"huge", **{b"f%d" % k: b"v" * 1000 for k in range(40)}}  # 41 fields, 40 KB
    ids = [r.xadd(stream, f).decode() for f in fields]
    source = StreamSource(r, stream, GROUP, "reader", limits)
    source.ensure_group()

    def brought(entries) -> int:  # bytes of fields the reply carried
        return sum(len(k) + len(v) for e in entries for k, v in e.fields.items())

    pages = []
    while got := source.read_new(100):
        assert brought(got) <= 4000 + 6096
        pages.append(got)
    # four of 909 bytes are under the budget, the fifth crosses it; the 40 KB entry crosses it alone
    assert [[e.stream_id for e in p] for p in pages] == [ids[:5], ids[5:6], ids[6:11], ids[11:]]
    assert [p.looked_at >= 4000 for p in pages] == [True, True, True, False]
    assert all(e.deliveries == 1 and (e.unread is None) == (e.stream_id != ids[5]) for p in pages for e in p)
    (huge,) = pages[1]
    assert huge.unread.size == sum(len(k) + len(v) for k, v in fields[5].items()) == pages[1].looked_at
    assert huge.unread.n_fields == 41 and len(huge.unread.fields) == 32
    assert all(n == len(v) for (_, n, _), v in zip(huge.unread.fields[1:], [b"v" * 1000] * 31))
    assert (
        all(len(head) <= 256 for _, _, head in huge.unread.fields) and huge.unread.ticket_id(huge.stream_id) == "huge"
    )
    assert huge.unread.reason().startswith("the entry is over the 6096 bytes a ticket can take")

    # a dead consumer's entries claimed page by page: each once, one delivery more, a deleted one dropped
    r.xdel(stream, ids[3])
    claimer = StreamSource(r, stream, GROUP, "claimer", limits)
    seen, gone, cursor = [], [], "0-0"
    while True:
        got, cursor, deleted = claimer.autoclaim(cursor, 100, 0)
        assert brought(got) <= 4000 + 6096
        seen += [(e.stream_id, e.deliveries, e.unread is not None) for e in got]
        gone += deleted
        if cursor == "0-0":
            break
    assert seen == [(i, 2, i == ids[5]) for i in ids if i != ids[3]] and gone == [ids[3]]
    assert r.xpending(stream, GROUP)["pending"] == 11  # the deleted one left the pending list, as XAUTOCLAIM does
    # and re-read as the claimer's own after a restart: again each once, one delivery more
    seen, after = [], "0"
    while after is not None:
        got, after = claimer.read_own_pending(after, 100)
        assert brought(got) <= 4000 + 6096
        seen += [(e.stream_id, e.deliveries, e.unread is not None) for e in got]
    assert seen == [(i, 3, i == ids[5]) for i in ids if i != ids[3]]


def test_an_unread_entrys_reason_names_the_field_over_its_limit_and_its_dead_letter_says_what_it_lacks():
    """Pure: the reason a producer reads, the ticket id a waiter keys on, and the excerpt of an entry never read."""

    def unread(*fields):
        return Unread(sum(len(n) + size for n, size, _ in fields), len(fields) + 40, fields, 10_096, 3000)

    text = unread((b"id", 3, b"T-1"), (b"subject", 10, b"s" * 10), (b"text", 9000, b"t" * 100))
    assert text.reason().startswith(
        "subject + text is 9010 bytes, over the limit of 3000 bytes (TRIAGE_MAX_TEXT_BYTES)"
    )
    meta = unread((b"text", 5, b"hello"), (b"meta", 12_000, b"{"))
    assert meta.reason().startswith("meta is 12000 bytes, over the limit of 3000 bytes")
    other = unread((b"text", 5, b"hello"), (b"attachment", 12_000, b"%PDF"))
    assert other.reason().startswith("the entry is over the 10096 bytes a ticket can take (2 x TRIAGE_MAX_TEXT_BYTES")
    assert all("TRIAGE_MAX_TEXT_BYTES" in u.reason() and len(u.reason()) < 400 for u in (text, meta, other))
    assert text.ticket_id("1-0") == "T-1"
    assert meta.ticket_id("1-0") is None  # 42 fields, 2 measured: an id may be among the others
    whole = Unread(12_014, 2, ((b"text", 5, b"hello"), (b"meta", 12_000, b"{")), 10_096, 3000)
    assert whole.ticket_id("1-0") == "1-0"  # no id field: the stream id, as parse_entry gives it
    assert unread((b"id", 300, b"x" * 200), (b"text", 9000, b"")).ticket_id("1-0") is None  # cut: not the id
    assert unread((b"id", 4, b"a\nb\x00"), (b"text", 9000, b"")).ticket_id("1-0") is None  # not a valid id
    letter = dead_letter_fields(
        stream_id="1-0", reason=other.reason(), payload={b"text": b"hello"}, deliveries=1, unread=other
    )
    assert (letter["payload_bytes"], letter["payload_sha256"], letter["payload_truncated"]) == (
        str(other.size),
        "",
        "1",
    )
    assert json.loads(letter["payload"]) == {"text": "hello", "…": "10 more fields"}  # 42 fields, 32 shown at most
