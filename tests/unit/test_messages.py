"""worker.stream.messages: parsing one stream entry into a ticket or a reason (fuzzed). Pure."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.stream.messages import Rejected, Ticket, parse_entry
from worker.stream.records import dead_letter_fields

SID = "1700000000000-0"
LIMIT = 1000


def parse(fields, max_text_bytes=LIMIT):
    return parse_entry(SID.encode(), fields, max_text_bytes=max_text_bytes)


# ----------------------------------------------------------------- parsing
def test_minimal_ticket_uses_stream_id_as_ticket_id():
    t = parse({b"text": b"I was charged twice"})
    assert t == Ticket(SID, SID, "I was charged twice", None)


def test_all_fields_subject_prepended_meta_echoed_unknown_ignored():
    t = parse(
        {
            b"id": b"T-1",
            b"subject": b"Refund",
            b"text": "caf\u00e9 charged".encode(),
            b"meta": b'{"customer": 7}',
            b"channel": b"mail",
        }
    )
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
    st.one_of(
        st.none(),
        st.text(
            alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FFF, exclude_categories=("Cc", "Cs")),
            min_size=1,
            max_size=40,
        ).filter(lambda s: s.strip()),
    ),
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
