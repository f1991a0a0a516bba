"""What the reader holds, and which of it the keeper refreshes: entries held as markers (too large to read) are
left out, since the refresh script's in-stream check (XRANGE) copies each entry whole inside Redis at every refresh
(three held 40 MB markers: 260 ms of Redis and 42 MB of Lua heap each time)."""

from __future__ import annotations

from types import SimpleNamespace

from worker.stream.in_flight import InFlight
from worker.stream.messages import Unread
from worker.stream.reader import Reader
from worker.stream.source import RawEntry

MARKER = Unread(size=40_000_000, n_fields=2, fields=(), limit=10_096, max_text_bytes=3000)


def test_markers_are_held_but_not_refreshed():
    f = InFlight()
    f.add(["1-0", "2-0", "3-0"], epoch=1, unread=["2-0"])
    assert f.snapshot(1) == ["1-0", "2-0", "3-0"]  # re-reads still skip every held id, markers included
    assert f.snapshot(1, whole_only=True) == ["1-0", "3-0"]
    f.discard(["2-0"], epoch=1)
    f.add(["2-0"], epoch=2)  # the same id read whole after a recreated group: refreshed again
    assert f.snapshot(2, whole_only=True) == ["2-0"]


def test_the_reader_takes_markers_as_held_and_hands_the_keeper_only_whole_entries():
    reader = SimpleNamespace(in_flight=InFlight(), _epoch=0, guard=SimpleNamespace(epoch=0))
    got = [
        RawEntry("1-0", {b"text": b"hi"}, 1, "new"),
        RawEntry("2-0", {b"text": b"xxx"}, 1, "new", unread=MARKER),
    ]
    assert Reader._take(reader, got) == got
    assert Reader._take(reader, got) == []  # held: not taken twice
    assert Reader.held(reader) == ["1-0"]


def test_lowest_is_the_least_id_held_in_any_epoch_in_stream_order():
    """The settle's trim stays below it (a window its group lost is still in the stream when it is written); kept
    as ids come and found again only once it leaves, so a write per pass does not scan every held id."""
    f = InFlight()
    assert f.lowest() is None
    f.add(["5-0", "10-1", "9-0"], 0)
    assert f.lowest() == "5-0"  # stream order, not string order ("10-1" < "5-0" as text)
    f.add(["2-0"], 1)
    f.discard(["2-0"], 0)  # held in another epoch: still held
    assert f.lowest() == "2-0"
    f.discard(["2-0"], 1)
    assert f.lowest() == "5-0"
    f.discard(["5-0", "9-0", "10-1"], 0)
    assert f.lowest() is None
    f.add(["11-0"], 2)
    assert f.lowest() == "11-0"


def test_lowest_leaves_out_the_ids_a_write_settles():
    """The write's own entries are settled in the script before its trim: capped at them, a window's last write
    kept the whole window in the stream."""
    f = InFlight()
    f.add(["5-0", "10-1", "9-0"], 0)
    assert f.lowest(excluding={"9-0"}) == "5-0"
    assert f.lowest(excluding={"5-0"}) == "9-0"
    assert f.lowest(excluding={"5-0", "9-0", "10-1"}) is None
    assert f.lowest() == "5-0"  # nothing is forgotten by asking


def test_lowest_agrees_with_a_scan_of_every_held_id_through_any_history():
    """Adds (new reads in order, claims of older ids, the same id in a later epoch), discards (a pass, a whole
    window, another epoch's id) and asks with and without a write's own ids left out, against the plain scan."""
    import random

    from worker.stream.source import id_order

    rng = random.Random(7)
    f, held = InFlight(), {}  # held: id -> epoch, the reference
    next_ms = 1000
    for _ in range(1500):
        op = rng.random()
        if op < 0.3:
            ids = [f"{next_ms + i // 2}-{i % 2}" for i in range(rng.randint(1, 40))]
            next_ms += 50
            epoch = rng.choice((0, 0, 0, 1))
        elif op < 0.4:
            ids, epoch = [f"{rng.randint(900, next_ms)}-{rng.randint(0, 1)}" for _ in range(5)], rng.choice((0, 1))
        else:
            ids = None
        if ids is not None:
            f.add(ids, epoch)
            held.update((i, epoch) for i in ids)
        elif op < 0.7 and held:
            epoch = rng.choice((0, 1))
            of_epoch = [i for i, e in held.items() if e == epoch or rng.random() < 0.1]  # a few another epoch's
            some = rng.sample(of_epoch, min(len(of_epoch), rng.randint(1, 60)))
            f.discard(some, epoch)
            for i in some:
                if held.get(i) == epoch:
                    del held[i]
        excluding = set(rng.sample(list(held), min(len(held), rng.randint(0, 20))))
        if held and rng.random() < 0.3:
            excluding.add(min(held, key=id_order))  # the write holding the lowest: the case that rescanned
        want = min((i for i in held if i not in excluding), key=id_order, default=None)
        assert f.lowest(excluding=excluding) == want
        assert f.lowest() == min(held, key=id_order, default=None)


def test_a_write_holding_the_lowest_id_does_not_rescan_every_held_id(monkeypatch):
    """Passes of equal-length tickets come in stream order, so each write held the lowest id: its floor was found
    by parsing every held id (4,096 in a window: ~2 ms a pass on this writer thread, under the reader's lock), and
    again once the pass was discarded. Ids are parsed once, when they come; a write pays for its own ids only."""
    from worker.stream import in_flight

    f = InFlight()
    window = [f"{1000 + i}-0" for i in range(4096)]
    f.add(window, 0)
    parsed: list[str] = []
    real = in_flight.id_order
    monkeypatch.setattr(in_flight, "id_order", lambda i: parsed.append(i) or real(i))
    for start in range(0, 4096, 64):
        own = window[start : start + 64]
        assert f.lowest(excluding=set(own)) == (window[start + 64] if start + 64 < 4096 else None)
        f.discard(own, 0)
        assert f.lowest() == (window[start + 64] if start + 64 < 4096 else None)
    assert len(parsed) == 0, len(parsed)
    f.add(["not-an-id"], 0)  # held above every id (a non-id string sorts last), then settled
    f.discard(["not-an-id"], 0)
    parsed.clear()
    f.add(window, 1)
    f.add(["9999-0"], 1)
    assert len(parsed) == 4096 + 2, len(parsed)  # each new id once, and the last held: no re-sort of all held
