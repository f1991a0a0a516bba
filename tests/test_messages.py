"""Pure unit tests of the stream worker's logic: message parsing (with fuzzing), latency
percentiles, the reconnect backoff schedule, per-item isolation of model errors,
window -> outcome, credential masking. No Redis, no model, no subprocess."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.bucketing import Pass
from worker.engine.types import InvalidTicket, PassStats, Prediction, Prepared, RunStats
from worker.logs import mask_url
from worker.stream.classify import run_passes
from worker.stream.connection import backoff_s
from worker.stream.messages import Rejected, Ticket, parse_entry
from worker.stream.metrics import Summary, WindowMetrics, pass_line, percentile
from worker.stream.records import dead_letter_fields
from worker.stream.sink import Outcome
from worker.stream.source import RawEntry
from worker.stream.window import build_window, to_outcome

SID = "1700000000000-0"
LIMIT = 1000


def parse(fields, max_text_bytes=LIMIT):
    return parse_entry(SID.encode(), fields, max_text_bytes=max_text_bytes)


# ----------------------------------------------------------------- parsing
def test_minimal_ticket_uses_stream_id_as_ticket_id():
    t = parse({b"text": b"I was charged twice"})
    assert t == Ticket(SID, SID, "I was charged twice", None)


def test_all_fields_subject_prepended_meta_echoed_unknown_ignored():
    t = parse({b"id": b"T-1", b"subject": b"Refund", b"text": "caf\u00e9 charged".encode(), b"meta": b'{"customer": 7}', b"channel": b"mail"})
    assert isinstance(t, Ticket)
    assert (t.ticket_id, t.text, t.meta) == ("T-1", "Refund\n\ncaf\u00e9 charged", '{"customer": 7}')


def test_blank_subject_is_not_prepended():
    assert parse({b"text": b"hello", b"subject": b"  "}).text == "hello"


@pytest.mark.parametrize(
    "fields, words",
    [
        ({}, "no fields"),
        (None, "no fields"),
        ({b"id": b"T-9"}, "no 'text' field"),
        ({b"txt": b"typo"}, "no 'text' field"),
        ({b"text": b""}, "empty"),
        ({b"text": b" \n\t "}, "empty"),
        ({b"text": b"\xff\xfe bad"}, "not valid UTF-8 (byte 0xff at position 0)"),
        ({b"text": b"ok", b"subject": b"\xc3("}, "subject is not valid UTF-8"),
        ({b"text": b"x" * (LIMIT + 1)}, f"over the limit of {LIMIT} bytes"),
        ({b"text": b"x" * 600, b"subject": b"y" * 600}, "subject + text is 1200 bytes"),
        ({b"text": b"ok", b"meta": b"{not json"}, "meta is not valid JSON"),
        ({b"text": b"ok", b"meta": b"[1, 2]"}, "meta must be a JSON object, got a JSON array"),
        ({b"text": b"ok", b"meta": b"42"}, "got a JSON number"),
        ({b"text": b"ok", b"meta": b"[" * 400 + b"]" * 400}, "meta must be a JSON object"),
        ({b"text": b"ok", b"meta": b"{}" * 501}, "meta is 1002 bytes, over the limit"),
        ({b"text": b"ok", b"id": b""}, "id is empty"),
        ({b"text": b"ok", b"id": b"a\nb"}, "control characters"),
        ({b"text": b"ok", b"id": "a\u0085b".encode()}, "control characters (U+0085 at position 1"),
        ({b"text": b"ok", b"id": "\u009b31m".encode()}, "control characters (U+009B at position 0"),
        ({b"text": b"ok", b"id": b"i" * 300}, "longer than 256 bytes"),
        ({b"text": b"ok", b"id": b"\x80"}, "id is not valid UTF-8"),
    ],
)
def test_bad_entries_are_rejected_with_a_readable_reason(fields, words):
    r = parse(fields)
    assert isinstance(r, Rejected), r
    assert words in r.reason
    assert r.stream_id == SID


def test_deeply_nested_valid_meta_is_not_called_invalid():
    deep = b'{"a": ' * 3000 + b"1" + b"}" * 3000  # valid JSON, deeper than the parser's recursion limit
    r = parse({b"text": b"ok", b"meta": deep}, max_text_bytes=100_000)
    assert isinstance(r, Rejected) and "nested too deeply" in r.reason and "not valid" not in r.reason


def test_rejection_keeps_the_ticket_id_when_it_is_known():
    assert parse({b"id": b"T-5", b"text": b""}).ticket_id == "T-5"
    assert parse({b"id": b"", b"text": b"x"}).ticket_id is None


def test_size_limit_is_checked_on_bytes_before_decoding():
    # 400 three-byte characters = 1200 bytes > 1000, although only 400 characters
    assert "1200 bytes" in parse({b"text": ("\u20ac" * 400).encode()}).reason


FIELD_NAMES = st.one_of(st.sampled_from([b"text", b"id", b"subject", b"meta", "text", "id"]), st.binary(max_size=8))
STREAM_IDS = st.from_regex(r"\A[0-9]{1,13}-[0-9]{1,4}\Z").flatmap(lambda s: st.sampled_from([s, s.encode()]))
FIELD_VALUES = st.one_of(st.binary(max_size=64), st.text(max_size=64), st.integers(), st.none(), st.floats())


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(FIELD_NAMES, FIELD_VALUES, max_size=6), STREAM_IDS, st.integers(1, 80))
def test_fuzz_parser_never_raises_and_always_explains(fields, stream_id, limit):
    r = parse_entry(stream_id, fields, max_text_bytes=limit)
    assert isinstance(r, (Ticket, Rejected))
    if isinstance(r, Rejected):
        assert isinstance(r.reason, str) and len(r.reason) > 10
    else:
        assert r.text.strip() and r.ticket_id
        assert len(r.text.encode("utf-8")) <= limit + 2  # subject + "\n\n" + text
        assert r.meta is None or isinstance(json.loads(r.meta), dict)
    # the dead-letter record of any entry is valid JSON, whatever bytes it held
    rec = dead_letter_fields(stream_id="1-0", reason="x", payload=fields, deliveries=1)
    assert isinstance(json.loads(rec["payload"]), dict)


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=1, max_size=200).filter(lambda s: s.strip()),
    st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FFF,
                                                        exclude_categories=("Cc", "Cs")),
                                 min_size=1, max_size=40).filter(lambda s: s.strip())),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
)
def test_fuzz_valid_tickets_round_trip(text, ticket_id, meta):
    fields = {b"text": text.encode("utf-8", "surrogatepass")}
    if ticket_id is not None:
        fields[b"id"] = ticket_id.encode()
    if meta is not None:
        fields[b"meta"] = json.dumps(meta).encode()
    r = parse_entry(SID, fields, max_text_bytes=10_000)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates are not UTF-8: must be rejected, not crash
        assert isinstance(r, Rejected) and "UTF-8" in r.reason
        return
    assert isinstance(r, Ticket), r
    assert r.text == text and r.ticket_id == (ticket_id or SID)
    assert (r.meta is None) == (meta is None) and (meta is None or json.loads(r.meta) == meta)


# ------------------------------------------------------- metrics / backoff
def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([10, 0, 5], 0) == 0 and percentile([10, 0, 5], 100) == 10
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_window_line_has_the_canonical_fields_from_the_engine_stats():
    stats = RunStats()
    stats.add(PassStats(items=3, real_tokens=20, padded_tokens=24, prefix_tokens_reused=30, infer_ms=10))
    stats.add(PassStats(items=1, real_tokens=10, padded_tokens=16, infer_ms=5))
    m = WindowMetrics(window=3, stats=stats, items=4, tokenize_ms=1, write_ms=4, latencies_ms=[10, 20, 30, 40])
    line = m.line()
    assert line["window"] == 3 and line["passes"] == 2 and line["infer_ms"] == 15.0
    assert line["padding_pct"] == 25.0 and line["items_per_s"] == 200.0
    assert line["latency_p50_ms"] == 25.0 and line["latency_p99_ms"] == pytest.approx(39.7)
    for key in ("prefix_tokens_reused", "read_ms", "backlog", "pending", "dead_lettered", "split_retries"):
        assert key in line
    p = pass_line(3, 1, stats, split_retries=0)
    assert (p["window"], p["pass"], p["items"], p["padding_pct"]) == (3, 1, 4, 25.0)


def test_summary_covers_one_period_then_resets():
    s = Summary(period_s=10, now_s=100.0)
    assert not s.due(105.0) and s.due(110.0)
    stats = RunStats()
    stats.add(PassStats(items=50, real_tokens=90, padded_tokens=100))
    s.add(WindowMetrics(window=1, stats=stats, items=50, dead_lettered=2, latencies_ms=[1.0, 3.0]))
    line = s.take(110.0)
    assert (line["items"], line["dead_lettered"], line["items_per_s"], line["latency_p50_ms"]) == (50, 2, 5.0, 2.0)
    assert (line["windows"], line["passes"], line["padding_pct"]) == (1, 1, 10.0)
    assert s.take(120.0)["items"] == 0


def test_backoff_schedule_doubles_then_caps():
    assert [backoff_s(n, base_s=0.1, max_s=1.0) for n in range(0, 7)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff_s(10_000, max_s=10.0) == 10.0
    assert backoff_s(3, base_s=1.0, max_s=10.0, jitter=0.5) == 2.0


def test_mask_url_hides_passwords_only():
    assert mask_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert mask_url("rediss://user:p%40ss@h/1 and redis://h2") == "rediss://user:***@h/1 and redis://h2"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# ---------------------------------------------- isolation, window, outcome
def _pred(label="billing"):
    return Prediction(label=label, scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=3)


def _prep(tag: int):
    return Prepared(ids=(tag, 1, 2), n_text_tokens=1, truncated=False)


def test_a_failing_pass_is_rerun_ticket_by_ticket_and_the_others_are_untouched():
    calls = []

    def classify_passes(items, passes):
        for p in passes:
            calls.append(p.size)
            if any(items[i].ids[0] == 13 for i in p.indices):
                raise RuntimeError("bad tensor")
            yield p.indices, [_pred() for _ in p.indices], PassStats(items=p.size, real_tokens=3 * p.size,
                                                                      padded_tokens=3 * p.size)

    items = [_prep(1), _prep(13), _prep(2), _prep(4)]
    plan = [Pass((0, 1, 2), (3, 3, 3)), Pass((3,), (3,))]
    out = list(run_passes(classify_passes, plan, items))
    assert calls == [3, 1, 1, 1, 1]
    assert [r.indices for r in out] == [(0, 1, 2), (3,)] and [r.split_retries for r in out] == [3, 0]
    assert isinstance(out[0].predictions[1], RuntimeError) and out[0].predictions[0] == out[0].predictions[2] == _pred()
    assert (out[0].stats.passes, out[0].stats.items, out[0].stats.real_tokens) == (2, 2, 6)
    assert out[1].predictions == [_pred()] and out[1].stats.passes == 1


def _entry(i, fields, deliveries=1):
    return RawEntry(f"1700000000{i:03d}-0", fields, deliveries, "new")


def _fake_prepare(texts):
    return [InvalidTicket("ticket is 9 tokens, over the limit") if "LONG" in t else Prepared((len(t),), 1, False) for t in texts]


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

    w = build_window([_entry(1, {b"text": b"ok"}), _entry(2, {b"text": b"BOOM"})], "new", prepare, max_text_bytes=100, max_deliveries=5)
    assert len(w.tickets) == 1 and "tokenizer failed on this ticket (ValueError: tokenizer exploded)" in w.rejected[0][2]


def test_empty_outcome_only_is_empty():
    assert Outcome().only({"x"}).ack_ids == []
