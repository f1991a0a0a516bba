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
from worker.stream import read_scripts
from worker.stream import source as source_module
from worker.stream.messages import Unread, as_text, entry_max_bytes
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
    # the deleted one left the pending list, as XAUTOCLAIM drops it; Redis 6.2's XCLAIM keeps it (on the claimer,
    # whose dead letter of it acks it: reader._dead_letter_deleted)
    kept = [ids[3]] if int(r.info("server")["redis_version"].split(".")[0]) < 7 else []
    assert set(_pending(r, stream)) == {i for i in ids if i != ids[3]} | set(kept)
    if kept:
        r.xack(stream, GROUP, *kept)  # what the reader does with its dead letter
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


def _pending(r: redis.Redis, stream: str) -> dict[str, int]:
    rows = r.xpending_range(stream, GROUP, min="-", max="+", count=1000)
    return {as_text(row["message_id"]): int(row["times_delivered"]) for row in rows}


def test_entry_max_bytes_is_the_last_size_read_whole_in_every_read_and_a_window_stays_in_stream_order(
    redis_url, key_prefix
):
    """An entry of exactly entry_max_bytes comes whole, one byte more as its measure, in reads of new, own pending
    and claimed entries alike; the entries of a read come in stream order, markers among them (the script returns
    them apart: the worker had them after every whole one, so a window's dead letters were out of order)."""
    r = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    limits = ReadLimits(max_text_bytes=1000, excerpt_bytes=256, max_bytes=100_000)  # entry_max_bytes 6,096
    at_max = {b"id": b"a", b"text": b"t" * (6096 - len(b"idatext"))}
    over = {b"id": b"b", b"text": b"t" * (6097 - len(b"idbtext"))}
    fields = [at_max, over, {b"id": b"c", b"text": b"hello"}, over, at_max]
    ids = [r.xadd(stream, f).decode() for f in fields]
    source = StreamSource(r, stream, GROUP, "reader", limits)
    source.ensure_group()
    expected = [(i, e is over) for i, e in zip(ids, fields)]
    got = source.read_new(10)
    assert [(e.stream_id, e.unread is not None) for e in got] == expected
    assert got[0].fields == at_max and got[1].unread.size == 6097 and got.looked_at == 2 * 6096 + 2 * 6097 + 12
    got, _ = source.read_own_pending("0", 10)
    assert [(e.stream_id, e.unread is not None) for e in got] == expected
    got, _, _ = StreamSource(r, stream, GROUP, "claimer", limits).autoclaim("0-0", 10, 0)
    assert [(e.stream_id, e.unread is not None) for e in got] == expected


def test_an_unread_entry_keeps_every_field_pair_odd_names_included_and_its_reason_names_a_field_given_twice(
    redis_url, key_prefix
):
    """Markers of entries with a known field twice, a binary field name and a name over 64 bytes: every pair kept
    as sent (``EntryFields``), the dead letter's excerpt shows them all; a field given twice is the reason, as for an
    entry read whole (the sum of the two was named as the text's size: 5000 bytes, while each was 2500)."""
    r = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    limits = ReadLimits(max_text_bytes=1000, excerpt_bytes=256)
    flat = ["id", "c", "text", "t" * 2500, "text", "u" * 2500, "meta", "m" * 2000]
    twice = r.execute_command("XADD", stream, "*", *flat)
    odd = r.execute_command("XADD", stream, "*", b"\xff\xfe\x00k", "v" * 7000, "n" * 100, "w", "id", "d")
    source = StreamSource(r, stream, GROUP, "reader", limits)
    source.ensure_group()
    a, b = source.read_new(10)
    assert (a.stream_id, b.stream_id) == (twice.decode(), odd.decode()) and a.unread and b.unread
    assert [k for k, _ in a.fields.pairs] == [b"id", b"text", b"text", b"meta"]
    assert a.unread.reason().startswith("the entry gives 'text' more than once; the entry (7015 bytes) was too large")
    assert a.unread.ticket_id(a.stream_id) == "c"  # as parse_entry gives it for a text given twice
    assert [k for k, _ in b.fields.pairs] == [b"\xff\xfe\x00k", b"n" * 64, b"id"]
    assert b.unread.ticket_id(b.stream_id) == "d" and b.unread.reason().startswith("the entry is over the 6096 bytes")
    for e in (a, b):
        letter = dead_letter_fields(stream_id=e.stream_id, reason="", payload=e.fields, deliveries=1, unread=e.unread)
        shown = json.loads(letter["payload"])
        assert len(shown) == len(e.fields.pairs) and letter["payload_bytes"] == str(e.unread.size)
    assert list(shown) == ["\\xff\\xfe\x00k", "n" * 64, "id"]


def test_delivery_counts_are_those_xreadgroup_and_xautoclaim_give(redis_url, key_prefix):
    """The same entries read through the scripts and through the commands they replace, side by side: a first
    read, two re-reads of the reader's own pending entries after restarts (XREADGROUP 0), a claim by another
    consumer (XAUTOCLAIM) and its own re-read. Each entry's delivery count is the same on both streams at every
    step, an unread one's too, so TRIAGE_MAX_DELIVERIES trips at the same count as before."""
    r = redis.Redis.from_url(redis_url)
    ours, theirs = key_prefix + "scripts", key_prefix + "commands"
    limits = ReadLimits(max_text_bytes=1000, excerpt_bytes=256)
    fields = [{"id": f"t-{i}", "text": "t" * (9000 if i == 2 else 100)} for i in range(5)]
    for stream in (ours, theirs):
        for f in fields:
            r.xadd(stream, f)
        r.xgroup_create(stream, GROUP, id="0")
    reader, claimer = StreamSource(r, ours, GROUP, "a", limits), StreamSource(r, ours, GROUP, "b", limits)
    seen = []
    steps = [
        (lambda: reader.read_new(10), lambda: r.xreadgroup(GROUP, "a", {theirs: ">"}, count=10)),
        (lambda: reader.read_own_pending("0", 10)[0], lambda: r.xreadgroup(GROUP, "a", {theirs: "0"}, count=10)),
        (lambda: reader.read_own_pending("0", 10)[0], lambda: r.xreadgroup(GROUP, "a", {theirs: "0"}, count=10)),
        (lambda: claimer.autoclaim("0-0", 10, 0)[0], lambda: r.xautoclaim(theirs, GROUP, "b", 0, count=10)),
        (lambda: claimer.read_own_pending("0", 10)[0], lambda: r.xreadgroup(GROUP, "b", {theirs: "0"}, count=10)),
    ]
    for script, command in steps:
        got = script()
        command()
        assert list(_pending(r, ours).values()) == list(_pending(r, theirs).values())
        assert [e.deliveries for e in got] == list(_pending(r, ours).values())
        seen.append(got[2].deliveries)
    assert seen == [1, 2, 3, 4, 5] and got[2].unread is not None


def test_a_read_of_many_unread_entries_collects_their_copies_per_gc_bytes_not_per_entry(redis_url, key_prefix):
    """300 entries of 40 KB (12 MB), each over entry_max_bytes, in one read: READ_NEW as the worker sends it, with
    Lua's ``collectgarbage`` counted. A full collection walks all the read holds, so one per marker made such a read
    cost Redis about twice its time (docs/worker.md, "Read size"); one per GC_BYTES of copies keeps Lua's garbage
    as bounded (at most GC_BYTES beside the entry being measured)."""
    r = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    pipe = r.pipeline(transaction=False)
    for i in range(300):
        pipe.xadd(stream, {"id": f"m-{i}", "text": "x" * 40_000})
    pipe.execute()
    source = StreamSource(r, stream, GROUP, "reader", ReadLimits(max_text_bytes=1000, max_bytes=10**9))
    source.ensure_group()
    counted = "local gc, runs = collectgarbage, 0\nlocal function collectgarbage() runs = runs + 1 return gc() end\n"
    returns = "return {whole, unread, used}"
    script = counted + read_scripts.READ_NEW.replace(returns, returns[:-1] + ", runs}")
    assert script.endswith("return {whole, unread, used, runs}\n")  # the read's own return, extended
    whole, unread, looked_at, runs = r.eval(script, 1, stream, *source._head(10**9), 1000)
    assert not whole and len(unread) == 3 * 300 and looked_at == sum(len(f"m-{i}") + 40_006 for i in range(300))
    assert runs == looked_at // read_scripts.GC_BYTES  # 1, where a collection per entry ran 300


class _Clock:
    """``time`` as source.py sees it: a sleep advances the clock at once, and is recorded."""

    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_the_wait_for_new_entries_asks_less_often_after_a_quiet_spell_and_quickly_again_once_one_came(
    redis_url, key_prefix, monkeypatch
):
    """Scripts cannot block, so an idle worker polls (real reads of a real, empty stream; a clock that sleeps at
    once). For the first POLL_SLOW_AFTER_S without a new entry it asks after 1, 2, 4 ... ms, then every 20 ms; after
    that every POLL_SLOW_S (it asked ~58 times a second however long it had been idle: ~2.5 % of a core and ~58 Lua
    scripts a second in Redis per idle worker, docs/worker.md "Read size"), also across the reader's 500 ms waits;
    the first entry makes the next wait (the one that fills the window) fast again."""
    r = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    source = StreamSource(r, stream, GROUP, "reader", ReadLimits(max_text_bytes=1000))
    source.ensure_group()
    clock = _Clock()
    monkeypatch.setattr(source_module, "time", clock)

    def idle_for(seconds: float) -> list[float]:  # the reader's idle loop: one 500 ms wait after another
        start, clock.slept = clock.now, []
        while clock.now - start < seconds:
            assert not source.read_new(16, 500)
        return clock.slept

    quiet_s = source_module.POLL_SLOW_AFTER_S
    fast = idle_for(quiet_s - 1)
    assert fast[:6] == [0.001, 0.002, 0.004, 0.008, 0.016, 0.02] and max(fast) == 0.02
    assert len(fast) > 0.9 * (quiet_s - 1) / 0.02
    idle_for(1.5)  # past POLL_SLOW_AFTER_S
    slow = idle_for(3.0)
    assert max(slow) == source_module.POLL_SLOW_S == 0.1 and min(slow[:4]) == 0.1  # no restart at 1 ms per wait
    assert len(slow) <= 3.0 / 0.1 + 6  # ~10 reads a second (a wait's last sleep is cut to its end)

    r.xadd(stream, {"id": "t-1", "text": "hello"})
    assert len(source.read_new(16, 500)) == 1 and clock.slept == slow  # asked at once: no sleep before it
    clock.slept = []
    assert not source.read_new(15, 50)  # the fill of the window: fast again
    assert clock.slept[:5] == [0.001, 0.002, 0.004, 0.008, 0.016] and max(clock.slept) <= 0.02


def test_a_stop_ends_the_wait_for_new_entries(redis_url, key_prefix, monkeypatch):
    """The fill of a window waited out all of TRIAGE_MAX_WAIT_MS whatever happened: a warm stop with a long one
    took that much longer than the one read block docs/worker.md promises. The stop is checked between polls."""
    import threading

    r = redis.Redis.from_url(redis_url)
    source = StreamSource(r, key_prefix + "tickets", GROUP, "reader", ReadLimits(max_text_bytes=1000))
    source.ensure_group()
    clock = _Clock()
    monkeypatch.setattr(source_module, "time", clock)
    stop = threading.Event()
    real_sleep = clock.sleep

    def sleep_then_stop(s: float) -> None:  # the signal arrives during the third poll's pause
        real_sleep(s)
        if len(clock.slept) == 3:
            stop.set()

    clock.sleep = sleep_then_stop
    assert not source.read_new(16, 600_000, stop=stop)
    assert len(clock.slept) == 3 and clock.now - 1000.0 < 1  # not ten minutes of polls


def test_the_wait_for_a_first_new_entry_is_told_apart_from_the_read(redis_url, key_prefix):
    """A window's ``read_ms`` (and ``triage_window_read_duration_seconds``) counted the idle wait before its first
    ticket arrived (an audit: read_ms 451 ms for a ticket classified 59 ms after it was sent). ``read_new`` now says
    how long it waited before the read that found entries (``idle_s``), which the reader leaves out."""
    r = redis.Redis.from_url(redis_url)
    stream = key_prefix + "tickets"
    source = StreamSource(r, stream, GROUP, "reader")
    source.ensure_group()
    r.xadd(stream, {"id": "there", "text": "already queued"})
    assert source.read_new(10, block_ms=5000).idle_s == 0.0  # found by the first read: no wait

    polls = []
    real = source._read_new

    def read_then_send(count, budget):  # the ticket arrives after the third empty poll
        got = real(count, budget)
        polls.append(len(got))
        if len(polls) == 3:
            r.xadd(stream, {"id": "later", "text": "sent while the worker waited"})
        return got

    source._read_new = read_then_send
    got = source.read_new(10, block_ms=60_000)
    assert [e.fields[b"id"] for e in got] == [b"later"] and polls == [0, 0, 0, 1]
    assert got.idle_s > 0
