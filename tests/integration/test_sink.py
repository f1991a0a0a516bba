"""The settle write (``ResultSink.write``, real Redis): every record reaches its stream and its latest-result
key unchanged, field for field and in order, whatever its text, though it travels as one JSON string."""

from __future__ import annotations

import json
import uuid

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.stream.sink import Outcome, ResultSink


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")  # redis-py encodes strictly: no lone surrogates reach a write
    except UnicodeEncodeError:
        return False
    return True


# any text: quotes, backslashes, control characters, NUL, '%', non-ASCII, what JSON escapes and what it does not
text = st.text(max_size=120).filter(_encodable)
extra = st.dictionaries(text.filter(lambda k: k not in ("id", "stream_id")), text, max_size=6)


def _sink(
    client: redis.Redis, ns: str, *, stream: str = "in", group: str = "g", consumer: str | None = None
) -> ResultSink:
    """A sink on streams under ``ns``; ``consumer``: ownership-checked writes, as a worker's window makes."""
    return ResultSink(
        client,
        input_stream=ns + stream,
        group=group,
        consumer=consumer,
        results_stream=ns + "results",
        dead_letter_stream=ns + "dead",
        result_key_prefix=ns + "result:",
        result_ttl_s=60,
        results_maxlen=1000,
        dead_letter_maxlen=1000,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(result=extra, dead=extra, orphan=extra, ticket_id=text.filter(lambda t: t.strip() and t not in ("plain", "d")))
def test_any_record_reaches_its_stream_and_key_unchanged(redis_url, key_prefix, result, dead, orphan, ticket_id):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ns = f"{key_prefix}{uuid.uuid4().hex[:8]}:"
    results = [{"id": ticket_id, **result, "stream_id": "1-0"}, {"id": "plain", "label": "billing", "stream_id": "2-0"}]
    dead_letters = [{"stream_id": "3-0", **dead, "id": "d"}, {"stream_id": "4-0", **orphan}]  # the last: no id, no key
    _sink(client, ns).write(Outcome(results=results, dead_letters=dead_letters))

    assert [list(f.items()) for _, f in client.xrange(ns + "results")] == [list(r.items()) for r in results]
    assert [list(f.items()) for _, f in client.xrange(ns + "dead")] == [list(d.items()) for d in dead_letters]
    for rec, status in ((results[0], "ok"), (results[1], "ok"), (dead_letters[0], "dead_letter")):
        raw = client.get(ns + "result:" + rec["id"])
        assert raw == json.dumps({"status": status, **rec}, ensure_ascii=False)
    assert sorted(client.scan_iter(match=ns + "result:*")) == sorted(
        {ns + "result:" + k for k in (ticket_id, "plain", "d")}
    )


def test_the_largest_settings_redis_is_given_are_ones_it_accepts(redis_url, key_prefix):
    """A settle write with the largest TRIAGE_RESULT_TTL_S and TRIAGE_RESULTS_MAXLEN the settings take succeeds (a
    TTL of 1e16 s was "ERR invalid expire time" at every write, retried forever, each try adding its results again);
    a larger TTL is refused at start-up, naming the variable."""
    from worker import preflight
    from worker.settings import MAX_COUNT, MAX_SECONDS, Settings

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ns = f"{key_prefix}{uuid.uuid4().hex[:8]}:"
    sink = _sink(client, ns)
    sink.result_ttl_s, sink.results_maxlen, sink.dead_letter_maxlen = MAX_SECONDS, MAX_COUNT, MAX_COUNT
    sink.write(Outcome(results=[{"id": "t", "label": "billing", "stream_id": "1-0"}], dead_letters=[]))
    assert client.xlen(ns + "results") == 1 and client.ttl(ns + "result:t") > MAX_SECONDS - 60
    client.delete(ns + "results", ns + "result:t")
    settings, problems = preflight.load_settings(Settings, unknown=False, result_ttl_s=10**16)
    assert settings is None and [p.where for p in problems] == ["TRIAGE_RESULT_TTL_S"]
