"""What the reader holds, and which of it the keeper refreshes: entries held as markers (too large to read) are
left out, since the refresh script's in-stream check (XRANGE) copies each entry whole inside Redis at every refresh
(three held 40 MB markers: 260 ms of Redis and 42 MB of Lua heap each time)."""

from __future__ import annotations

from types import SimpleNamespace

from worker.stream.messages import Unread
from worker.stream.reader import InFlight, Reader
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
