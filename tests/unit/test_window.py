"""worker.stream.window: a drained window split into tickets, dead letters and acks. Pure (fake tokenizer)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_pass_isolation import _pred
from worker.engine.types import InvalidTicket, Prepared
from worker.stream.records import scores_json
from worker.stream.sink import Outcome
from worker.stream.source import RawEntry
from worker.stream.window import build_window, to_outcome


def _entry(i, fields, deliveries=1):
    return RawEntry(f"1700000000{i:03d}-0", fields, deliveries, "new")


def _fake_prepare(texts):
    return [
        InvalidTicket("ticket is 9 tokens, over the limit") if "LONG" in t else Prepared((len(t),), 1, False)
        for t in texts
    ]


def test_window_splits_good_bad_and_poison_entries_and_acks_all():
    entries = [
        _entry(1, {b"text": b"fine", b"id": b"A"}),
        _entry(2, {b"text": b""}),
        _entry(3, {b"text": b"LONG text", b"id": b"C"}),
        _entry(4, {b"text": b"poison", b"id": b"D"}, deliveries=6),
        _entry(5, {b"text": b"also fine", b"meta": b'{"k": 1}'}),
    ]
    w = build_window(entries, "new", _fake_prepare, max_text_bytes=100, max_deliveries=5)
    assert [t.ticket_id for t in w.tickets] == ["A", entries[4].stream_id]
    reasons = {sid: (tid, why) for sid, tid, why in [(e.stream_id, tid, why) for e, tid, why in w.rejected]}
    assert "empty" in reasons[entries[1].stream_id][1]
    assert reasons[entries[2].stream_id] == ("C", "ticket is 9 tokens, over the limit")
    assert reasons[entries[3].stream_id][0] == "D" and "delivered 6 times" in reasons[entries[3].stream_id][1]

    out, lat = to_outcome(w, [_pred(), RuntimeError("nan")], model="m", worker="w1", now_ms=1700000000100.0)
    assert [r["id"] for r in out.results] == ["A"] and out.results[0]["latency_ms"] == "99.0" and lat == [99.0]
    dead = {d["stream_id"]: d for d in out.dead_letters}
    assert "model failed on this ticket even when run alone (RuntimeError: nan)" in dead[entries[4].stream_id]["reason"]
    assert dead[entries[3].stream_id]["deliveries"] == "6"
    assert json.loads(dead[entries[1].stream_id]["payload"]) == {"text": ""}
    assert sorted(out.ack_ids) == sorted(e.stream_id for e in entries)
    part = out.only({entries[0].stream_id, entries[1].stream_id})
    assert (len(part.results), len(part.dead_letters), len(part.ack_ids)) == (1, 1, 2)


def test_tokenizer_crash_on_one_text_is_isolated():
    def prepare(texts):
        if any("BOOM" in t for t in texts):
            raise ValueError("tokenizer exploded")
        return [Prepared((1,), 1, False) for _ in texts]

    w = build_window(
        [_entry(1, {b"text": b"ok"}), _entry(2, {b"text": b"BOOM"})],
        "new",
        prepare,
        max_text_bytes=100,
        max_deliveries=5,
    )
    assert (
        len(w.tickets) == 1 and "tokenizer failed on this ticket (ValueError: tokenizer exploded)" in w.rejected[0][2]
    )


def test_empty_outcome_only_is_empty():
    assert Outcome().only({"x"}).ack_ids == []


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=20),  # label names with quotes, '%', backslashes, non-ASCII
        st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
        min_size=1,
        max_size=8,
    )
)
def test_scores_json_holds_each_probability_rounded_to_6_decimals(scores):
    """The ``scores`` field parses to what ``round(p, 6)`` gives, label for label and in order."""
    got = json.loads(scores_json(scores))
    assert list(got) == list(scores)
    assert [got[k] for k in scores] == [round(v, 6) for v in scores.values()]


def test_the_next_window_is_awaited_only_while_the_device_is_busy():
    """The loop's lookahead across windows: take the next window if it comes before the last pass is done."""
    from worker.stream.loop import wait_while

    def source(items):
        calls: list[float] = []

        def get(timeout_s):
            calls.append(timeout_s)
            return items.pop(0) if items else None

        return get, calls

    get, calls = source(["w1"])
    assert wait_while(get, busy=lambda: pytest.fail("ready at once: nothing to wait for")) == "w1" and calls == [0]
    get, calls = source([None, None, "w2"])
    busy = iter([True, True, True, True])
    assert wait_while(get, lambda: next(busy), poll_s=0.5) == "w2" and calls == [0, 0.5, 0.5]
    get, calls = source([None, None])
    busy = iter([True, False])
    assert wait_while(get, lambda: next(busy)) is None and len(calls) == 2  # the device finished: stop waiting
