"""The producer: submission fields and ids, backlog + backpressure, waiting for results, the CLI.

Real Redis under a unique key prefix; results are written with the worker's own
sink and record code (so the formats cannot drift apart), and one test runs the
real worker process against the client.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
import redis

from producer import BacklogFull, InvalidTicket, ProducerSettings, Result, Submitted, TriageClient, ticket_fields
from producer.cli import main as cli_main
from producer.local_redis import answers, demo_redis, local_redis_server
from tests.tcp_proxy import TcpProxy
from tests.worker_proc import start_worker
from worker.engine.classifier import Prediction
from worker.settings import Settings
from worker.stream.records import dead_letter_fields, result_fields
from worker.stream.sink import Outcome, ResultSink

GROUP = "triage"


@pytest.fixture
def settings(redis_url, key_prefix) -> ProducerSettings:
    return ProducerSettings(
        redis_url=redis_url,
        input_stream=key_prefix + "tickets",
        results_stream=key_prefix + "results",
        dead_letter_stream=key_prefix + "dead",
        result_key_prefix=key_prefix + "result:",
        group=GROUP,
    )


@pytest.fixture
def client(settings) -> TriageClient:
    return TriageClient(settings)


@pytest.fixture
def r(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _sink(r: redis.Redis, s: ProducerSettings) -> ResultSink:
    return ResultSink(
        r,
        input_stream=s.input_stream,
        group=s.group,
        results_stream=s.results_stream,
        dead_letter_stream=s.dead_letter_stream,
        result_key_prefix=s.result_key_prefix,
        result_ttl_s=60,
        results_maxlen=1000,
        dead_letter_maxlen=1000,
    )


def _classify(r: redis.Redis, s: ProducerSettings, ticket_ids: list[str], label: str = "billing") -> None:
    """What a worker writes for these tickets (real worker record + sink code)."""
    pred = Prediction(label=label, scores={label: 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    results = [
        result_fields(t, pred, latency_ms=12.5, model="m", worker="w", meta='{"k": 1}', stream_id="1-0")
        for t in ticket_ids
    ]
    _sink(r, s).write(Outcome(results=results))


# ------------------------------------------------------------------ submit
def test_defaults_meet_the_worker_on_the_same_keys(monkeypatch):
    for k in list(os.environ):
        if k.startswith("TRIAGE_"):
            monkeypatch.delenv(k)
    p, w = ProducerSettings(), Settings()
    for name in ("redis_url", "input_stream", "results_stream", "dead_letter_stream", "result_key_prefix", "group"):
        assert getattr(p, name) == getattr(w, name), name


@pytest.mark.parametrize(
    "var, value, words",
    [
        ("TRIAGE_RESULT_KEY_PREFIX", "", "must not be empty"),  # a bare ticket id would be read as its result key
        ("TRIAGE_INPUT_STREAM", " ", "must not be empty"),
        ("TRIAGE_BACKPRESSURE_TIMEOUT_S", "inf", "finite"),
    ],
)
def test_the_cli_refuses_names_and_numbers_the_worker_refuses(monkeypatch, capsys, var, value, words):
    monkeypatch.setenv(var, value)
    assert cli_main(["backlog"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"triage-producer backlog: {var}: ") and words in err, err


def test_submit_one_writes_flat_fields_and_returns_ids(client, r, settings):
    sent = client.submit("Refund please", id="T-1", subject="Billing", meta={"customer": 42, "tier": "gold"})
    assert sent.ticket_id == "T-1"
    [(sid, fields)] = r.xrange(settings.input_stream)
    assert sid == sent.stream_id
    assert fields == {
        "text": "Refund please",
        "id": "T-1",
        "subject": "Billing",
        "meta": '{"customer": 42, "tier": "gold"}',
    }


def test_submit_many_in_order_generated_ids_and_progress(client, r, settings):
    client.settings.submit_chunk_size = 3
    progress: list[int] = []
    tickets = ["plain string", {"text": "with id", "id": 7}, {"text": "raw meta", "meta": '{"a": 1}'}] + [
        f"t{i}" for i in range(5)
    ]
    sent = client.submit_many(tickets, on_progress=progress.append)
    assert progress == [3, 3, 2]
    rows = r.xrange(settings.input_stream)
    assert [s.stream_id for s in sent] == [sid for sid, _ in rows]
    assert [f["text"] for _, f in rows] == ["plain string", "with id", "raw meta"] + [f"t{i}" for i in range(5)]
    assert sent[1].ticket_id == "7"
    assert rows[2][1]["meta"] == '{"a": 1}'
    generated = [s.ticket_id for i, s in enumerate(sent) if i != 1]
    assert len(set(generated)) == len(generated) and all(len(t) == 32 for t in generated)
    assert [f["id"] for _, f in rows] == [s.ticket_id for s in sent]


def test_bad_ticket_shapes_are_refused_before_sending(client, r, settings):
    with pytest.raises(TypeError):
        client.submit(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        client.submit_many([{"subject": "no text"}])
    with pytest.raises(TypeError, match="id must be a string or a number"):
        client.submit("charged twice", id={"crm": 7})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ticket id must be a str, got dict"):  # an AttributeError from .strip()
        ticket_fields("charged twice", ticket_id={"crm": 7})  # type: ignore[arg-type]
    assert r.xlen(settings.input_stream) == 0
    assert client.submit("charged twice", id=7).ticket_id == "7"  # a number is still its text


@pytest.mark.parametrize(
    ("ticket", "why"),
    [
        ({"text": "t", "id": "x" * 257}, "longer than 256 bytes"),
        ({"text": "t", "id": "line\nbreak"}, "control characters"),
        ({"text": "t", "id": "  "}, "id is empty"),
        ({"text": "t", "meta": [1, 2]}, "meta must be a dict"),
        ({"text": "t", "meta": {"score": float("nan")}}, "meta is not valid JSON"),  # was sent as NaN: no JSON
        ({"text": 42}, "must be a str"),
        ({"text": "half \ud83d emoji"}, "text contains characters that are not valid Unicode"),
        ({"text": "t", "subject": "\udc80"}, "subject contains characters that are not valid Unicode"),
        # str() sent these as the ids "{'a': 1}", "['T-1']" and "True": ids the caller never gave and cannot wait on
        ({"text": "t", "id": {"a": 1}}, "id must be a string or a number, got a dict (a JSON object)"),
        ({"text": "t", "id": ["T-1"]}, "id must be a string or a number, got a list (a JSON array)"),
        ({"text": "t", "id": True}, "id must be a string or a number, got a boolean"),
        ({"text": "t", "id": float("nan")}, "id must be a string or a finite number"),
        ({"text": "t", "subject": {"a": 1}}, "subject must be a string or a number, got a dict"),
    ],
)
def test_a_ticket_the_worker_would_reject_without_an_id_stops_a_list_before_anything_is_sent(
    client, r, settings, ticket, why
):
    """Its dead letter would carry no id, so ``wait`` could only time out on it (and a list meta is never a JSON
    object): the whole list is checked before the first chunk goes."""
    with pytest.raises(InvalidTicket) as refused:
        client.submit_many([{"text": "fine", "id": "T-1"}, "fine too", ticket])
    assert refused.value.index == 2 and why in refused.value.reason and refused.value.submitted == []
    assert not r.exists(settings.input_stream)


def test_a_ticket_redis_refuses_mid_chunk_leaves_the_ones_it_added_in_submitted(settings):
    """Out of memory part-way through a chunk: every reply came back, so the tickets Redis added are ``submitted``
    (a resume must not send them again) and none is "unconfirmed" (that is for a lost reply)."""
    with local_redis_server() as url:
        own = redis.Redis.from_url(url)
        own.config_set("maxmemory-policy", "noeviction")
        own.config_set("maxmemory", int(own.info("memory")["used_memory"]) + 300_000)
        client = TriageClient(settings.model_copy(update={"redis_url": url, "input_max_backlog": 0}))
        with pytest.raises(redis.ResponseError) as refused:
            client.submit_many([{"text": f"{i} " + "x" * 800} for i in range(2000)])
        e = refused.value
        assert "OOM" in str(e) or isinstance(e, redis.exceptions.OutOfMemoryError)
        assert e.unconfirmed == [] and 0 < len(e.submitted) < 2000 and e.refused
        in_stream = {sid.decode() for sid, _ in own.xrange(settings.input_stream)}
        assert {s.stream_id for s in e.submitted} == in_stream
        # every ticket up to the end of the refused chunk was answered: added (submitted) or refused, never both
        sent = {s.ticket_id for s in e.submitted}
        assert not sent & set(e.refused) and len(sent) + len(e.refused) <= 2000


def test_replies_that_mix_ids_and_refusals_say_which_were_refused(settings, monkeypatch, capsys):
    """Redis checks memory before each command, and other clients free some between them: b refused, c and d
    added. A resume must re-send b, not start after len(submitted)."""
    client = TriageClient(settings.model_copy(update={"input_max_backlog": 0}))

    class Replies:  # the pipeline's own replies, in order (pure logic: which ticket got which)
        def __init__(self):
            self.n = 0

        def xadd(self, *a, **kw):
            self.n += 1

        def execute(self, raise_on_error=True):
            return ["1-1", redis.exceptions.OutOfMemoryError("command not allowed"), "1-3", "1-4"][: self.n]

    monkeypatch.setattr(client.redis, "pipeline", lambda transaction=False: Replies())
    with pytest.raises(redis.ResponseError) as refused:
        client.submit_many([{"id": t, "text": "x"} for t in "abcd"])
    e = refused.value
    assert [s.ticket_id for s in e.submitted] == ["a", "c", "d"] and e.refused == ["b"] and e.unconfirmed == []
    from producer.cli import _partial

    assert "1 refused, not sent: b" in _partial(e)


def test_a_redis_error_part_way_through_a_send_says_what_was_sent(r, settings, redis_url):
    """Redis lost between two chunks (a real outage, through a proxy, at the second chunk's backlog check: its
    first XLEN): the call raises, with what it had sent."""
    host, port = urlparse(redis_url).hostname, urlparse(redis_url).port
    with TcpProxy(host, port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/{urlparse(redis_url).path.lstrip('/') or 0}"
        client = TriageClient(settings.model_copy(update={"submit_chunk_size": 2, "redis_url": url}))
        proxy.drop_at(b"XLEN", after=False, outage=True)  # the first chunk's check meets no stream: no XLEN
        with pytest.raises(redis.ConnectionError) as lost:
            client.submit_many([{"text": f"t{i}", "id": f"L-{i}"} for i in range(5)])
        assert proxy.triggered.wait(10)  # set by the proxy's thread just after its cut, which the client saw first
    assert [s.ticket_id for s in lost.value.submitted] == ["L-0", "L-1"] and lost.value.unconfirmed == []
    assert r.xlen(settings.input_stream) == 2


def test_xread_blocks_stay_under_the_socket_timeout(settings, redis_url):
    """0 asks for as long as it may (follow_results' "block forever"): under the timeout, not a 1 ms busy loop."""
    own = TriageClient(settings)  # built here: a 15 s socket timeout
    assert own._block_ms(0) == 13_500 and own._block_ms(500) == 500 and own._block_ms(60_000) == 13_500
    tiny = TriageClient(settings, client=redis.Redis.from_url(redis_url, socket_timeout=0.4))
    assert tiny._block_ms(0) == tiny._block_ms(5_000) == 360


def test_a_bad_ticket_in_a_generator_stops_the_call_and_says_what_was_sent(r, settings):
    client = TriageClient(settings.model_copy(update={"submit_chunk_size": 2}))
    tickets = ({"text": f"t{i}", "id": f"G-{i}" if i != 3 else ""} for i in range(5))  # "" becomes a uuid: fine
    assert len(client.submit_many(tickets)) == 5
    bad = ({"text": f"t{i}", "id": f"G-{i}" if i != 3 else "\x00"} for i in range(5))
    with pytest.raises(InvalidTicket) as refused:
        client.submit_many(bad)
    assert refused.value.index == 3 and [s.ticket_id for s in refused.value.submitted] == ["G-0", "G-1"]
    assert r.xlen(settings.input_stream) == 5 + 2  # the chunk that held the bad one was not sent


# ------------------------------------------------------------ backpressure
def test_backlog_is_lag_plus_pending_not_stream_length(client, r, settings):
    assert client.backlog() == 0  # no stream yet
    client.submit_many([f"t{i}" for i in range(6)])
    assert client.backlog() == 6  # no group yet: everything waits
    r.xgroup_create(settings.input_stream, GROUP, id="0")
    read = r.xreadgroup(GROUP, "c1", {settings.input_stream: ">"}, count=4)[0][1]
    r.xack(settings.input_stream, GROUP, read[0][0], read[1][0])
    assert r.xlen(settings.input_stream) == 6  # acked entries stay in the stream
    assert client.backlog() == 2 + 2  # 2 undelivered + 2 delivered-not-acked


def test_refuse_policy_raises_at_once_and_reports_what_was_sent(client, r, settings):
    s = client.settings
    s.input_max_backlog, s.backpressure, s.submit_chunk_size = 10, "refuse", 2
    client.submit_many([f"t{i}" for i in range(8)])
    with pytest.raises(BacklogFull) as info:
        client.submit_many([f"more{i}" for i in range(5)])
    assert info.value.backlog == 10 and info.value.limit == 10 and info.value.policy == "refuse"
    assert len(info.value.submitted) == 2  # the first chunk fitted (8 + 2 <= 10)
    assert "TRIAGE_INPUT_MAX_BACKLOG" in str(info.value)
    assert r.xlen(settings.input_stream) == 10  # nothing trimmed, nothing beyond the limit


def test_block_policy_waits_for_the_worker_to_catch_up(client, r, settings):
    s = client.settings
    s.input_max_backlog, s.backpressure, s.backpressure_timeout_s = 3, "block", 20.0
    client.submit_many(["a", "b", "c"])
    r.xgroup_create(settings.input_stream, GROUP, id="0")

    acking = threading.Event()

    def consume():
        time.sleep(0.3)  # the submit is waiting by then (were it not, it would not wait at all: still a pass)
        acking.set()
        for sid, _ in r.xreadgroup(GROUP, "c1", {settings.input_stream: ">"}, count=2)[0][1]:
            r.xack(settings.input_stream, GROUP, sid)

    t = threading.Thread(target=consume)
    t.start()
    sent = client.submit("d")  # blocks until two were consumed
    assert acking.is_set(), "submit returned before the worker caught up"
    t.join()
    assert client.backlog() == 2
    assert r.xrange(settings.input_stream)[-1][0] == sent.stream_id
    assert r.xlen(settings.input_stream) == 4


def test_block_policy_gives_up_after_its_timeout(client):
    s = client.settings
    s.input_max_backlog, s.backpressure, s.backpressure_timeout_s = 2, "block", 0.3
    client.submit_many(["a", "b"])
    with pytest.raises(BacklogFull) as info:
        client.submit("c")
    assert info.value.policy == "block" and info.value.waited_s >= 0.3


# ----------------------------------------------------------------- results
def test_wait_wakes_on_results_and_reports_dead_letters(client, r, settings):
    sent = client.submit_many([{"text": "x", "id": "a"}, {"text": "y", "id": "b"}, {"text": "", "id": "c"}])

    def worker():
        time.sleep(0.3)
        _classify(r, settings, ["a", "b"])
        dead = dead_letter_fields(
            stream_id=sent[2].stream_id, reason="text is empty", payload={"text": ""}, deliveries=1, ticket_id="c"
        )
        _sink(r, settings).write(Outcome(dead_letters=[dead]))

    t = threading.Thread(target=worker)
    t.start()
    got = client.wait(["a", "b", "c"], timeout_s=20)
    t.join()
    assert set(got) == {"a", "b", "c"}
    assert got["a"].ok and got["a"].label == "billing" and got["a"].score == pytest.approx(0.9)
    assert got["a"].scores == {"billing": 0.9, "other": 0.1} and got["a"].latency_ms == 12.5
    assert got["c"].status == "dead_letter" and got["c"].label is None and got["c"].reason == "text is empty"


def test_wait_returns_what_arrived_when_time_runs_out(client, r, settings):
    _classify(r, settings, ["done"])
    got = client.wait(["done", "never"], timeout_s=0.5)
    assert list(got) == ["done"]
    with pytest.raises(TimeoutError, match="never"):
        client.result("never", timeout_s=0.2)


def test_wait_for_many_ids_all_present(client, r, settings):
    ids = [f"id{i}" for i in range(2500)]  # several MGET chunks
    _classify(r, settings, ids, label="shipping")
    got = client.wait(ids, timeout_s=10)
    assert len(got) == 2500 and {x.label for x in got.values()} == {"shipping"}


def test_result_to_dict_decodes_types(client, r, settings):
    _classify(r, settings, ["z"])
    d = client.get_result("z").to_dict()
    assert d["id"] == "z" and d["status"] == "ok" and d["tokens"] == 7 and d["truncated"] is False
    assert d["meta"] == {"k": 1} and d["scores"]["billing"] == 0.9 and d["stream_id"] == "1-0"
    assert client.get_result("missing") is None
    assert Result.from_json("not json", ticket_id="q").status == "unreadable"


def test_recent_and_followed_results(client, r, settings):
    _classify(r, settings, ["r1", "r2", "r3"])
    recent = client.recent_results(2)
    assert [x.ticket_id for x in recent] == ["r2", "r3"]
    stop = threading.Event()
    seen: list[str] = []

    def follow():  # from after r3 (an explicit id: the thread may start after the writes below)
        for res in client.follow_results(since=recent[-1].result_entry_id, block_ms=100, stop=stop.is_set):
            seen.append(res.ticket_id)
            if len(seen) == 2:
                stop.set()

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.3)
    _classify(r, settings, ["r4", "r5"])
    t.join(10)
    assert seen == ["r4", "r5"]  # only the ones after the cursor


def _follow_all(client, since, n: int, **kw) -> list[Result]:
    """The first ``n`` outcomes ``follow_results`` yields (a bound in case fewer come: a failure, not a hang)."""
    deadline = time.monotonic() + 10
    seen: list[Result] = []
    for res in client.follow_results(since=since, block_ms=100, stop=lambda: time.monotonic() > deadline, **kw):
        seen.append(res)
        if len(seen) == n:
            break
    return seen


def _records_at(r, s) -> None:
    """Results at 1000-0 and 3000-0, dead letters at 2000-0 and 4000-0 (real worker records, ids chosen)."""
    pred = Prediction(label="billing", scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    for sid, tid in (("1000-0", "F-1"), ("3000-0", "F-3")):
        fields = result_fields(tid, pred, latency_ms=1.0, model="m", worker="w", stream_id=f"{sid[0]}-5")
        r.xadd(s.results_stream, fields, id=sid)
    for sid, tid in (("2000-0", "F-2"), ("4000-0", "F-4")):
        dead = dead_letter_fields(
            stream_id=f"{sid[0]}-5", reason=f"bad {tid}", payload={"id": tid, "text": ""}, deliveries=1, ticket_id=tid
        )
        r.xadd(s.dead_letter_stream, dead, id=sid)


def test_follow_and_recent_results_include_dead_letters_in_entry_order(client, r, settings):
    """``results --follow`` read only the results stream: an integrator following outcomes never saw a ticket
    that failed. Both streams now, each from its own cursor, merged by entry id."""
    _records_at(r, settings)
    got = _follow_all(client, "0", 4)
    assert [(x.ticket_id, x.status, x.reason) for x in got] == [
        ("F-1", "ok", None),
        ("F-2", "dead_letter", "bad F-2"),
        ("F-3", "ok", None),
        ("F-4", "dead_letter", "bad F-4"),
    ]
    assert [x.result_entry_id for x in got] == ["1000-0", "2000-0", "3000-0", "4000-0"]
    # an id is a moment in both streams: what each wrote after it
    assert [x.ticket_id for x in _follow_all(client, "2500-0", 2)] == ["F-3", "F-4"]
    # per stream, for an exact resume
    exact = {settings.results_stream: "3000-0", settings.dead_letter_stream: "0"}
    assert [x.ticket_id for x in _follow_all(client, exact, 2)] == ["F-2", "F-4"]
    assert [x.ticket_id for x in _follow_all(client, "0", 2, dead_letters=False)] == ["F-1", "F-3"]
    assert [x.ticket_id for x in client.recent_results(3)] == ["F-2", "F-3", "F-4"]
    assert [x.ticket_id for x in client.recent_results(3, dead_letters=False)] == ["F-1", "F-3"]
    with pytest.raises(ValueError, match="entry id"):
        client.follow_results(since="yesterday")


def test_outcome_tails_is_a_resume_point_that_sees_only_later_records(client, r, settings):
    """``outcome_tails()`` (public, documented) is "now" as a ``since``: each stream's last id, "0-0" when empty."""
    assert client.outcome_tails() == {settings.results_stream: "0-0", settings.dead_letter_stream: "0-0"}
    _records_at(r, settings)
    now = client.outcome_tails()
    assert now == {settings.results_stream: "3000-0", settings.dead_letter_stream: "4000-0"}
    _classify(r, settings, ["later"])
    assert [x.ticket_id for x in _follow_all(client, now, 1)] == ["later"]


def test_follow_from_now_sees_new_dead_letters_in_the_shape_wait_returns(client, r, settings):
    """'$' skips what both streams hold; a dead letter written later arrives as ``wait`` returns it (its fields
    decoded the same), with the dead-letter stream's entry id."""
    _records_at(r, settings)
    deadline = time.monotonic() + 10  # a bound in case they never come: a failure, not a hang
    # "$": both streams' tails are read here, before any write below (they were read at the first next())
    following = client.follow_results(block_ms=100, stop=lambda: time.monotonic() > deadline)
    sent = client.submit(" ", id="blank")
    _classify(r, settings, ["fresh"])
    _write_blank_dead_letter(r, settings, sent)
    seen = list(itertools.islice(following, 2))
    assert [(x.ticket_id, x.status) for x in seen] == [("fresh", "ok"), ("blank", "dead_letter")]
    followed = seen[1].to_dict()
    assert followed.pop("result_entry_id") == r.xrevrange(settings.dead_letter_stream, count=1)[0][0]
    assert followed == client.wait([sent], timeout_s=1)["blank"].to_dict()
    assert followed["reason"] == "text is empty" and followed["payload_truncated"] is False


def test_client_against_the_real_worker(client, triage_env, settings):
    env = {
        **triage_env,
        "TRIAGE_INPUT_STREAM": settings.input_stream,
        "TRIAGE_RESULTS_STREAM": settings.results_stream,
        "TRIAGE_DEAD_LETTER_STREAM": settings.dead_letter_stream,
        "TRIAGE_RESULT_KEY_PREFIX": settings.result_key_prefix,
    }
    sent = client.submit_many(
        [
            {"text": "I was charged twice", "id": "w1", "meta": {"crm": 5}},
            {"text": "app crashes", "subject": "Android"},
            {"text": " ", "id": "w3"},
        ]
    )
    with start_worker(env) as w:
        got = client.wait([s.ticket_id for s in sent], timeout_s=60)
        assert w.stop() == 0
    deadline = time.monotonic() + 10  # everything is written by now: a bound, so a miss fails and does not hang
    following = client.follow_results(since="0", block_ms=100, stop=lambda: time.monotonic() > deadline)
    followed = {x.ticket_id: x for x in itertools.islice(following, 3)}
    # what a follower sees of each ticket is what wait returned, the dead letter included
    assert {t: x.to_dict() | {"result_entry_id": None} for t, x in followed.items()} == {
        t: x.to_dict() | {"result_entry_id": None} for t, x in got.items()
    }
    assert followed["w3"].status == "dead_letter" and "empty" in followed["w3"].reason
    assert len(got) == 3
    assert got["w1"].ok and got["w1"].label in {"billing", "technical", "account", "shipping", "other"}
    assert json.loads(got["w1"].fields["meta"]) == {"crm": 5}
    assert got[sent[1].ticket_id].ok
    assert got["w3"].status == "dead_letter" and "empty" in got["w3"].reason


# --------------------------------------------------------------------- CLI
@pytest.fixture
def cli_env(monkeypatch, settings):
    for name in ("redis_url", "input_stream", "results_stream", "dead_letter_stream", "result_key_prefix", "group"):
        monkeypatch.setenv(f"TRIAGE_{name.upper()}", str(getattr(settings, name)))
    return settings


def test_cli_send_jsonl_and_csv(cli_env, r, tmp_path, capsys):
    jl = tmp_path / "t.jsonl"
    jl.write_text(
        '{"text": "one", "id": "j1", "meta": {"a": 1}}\n\n{"text": "two", "subject": "S"}\n', encoding="utf-8"
    )
    csv_file = tmp_path / "t.csv"
    csv_file.write_text('id,text,subject,meta\nc1,"three, with comma",Hello,"{""b"": 2}"\n,four,,\n', encoding="utf-8")
    ids_out = tmp_path / "ids.jsonl"
    assert cli_main(["send", str(jl), "--ids-out", str(ids_out)]) == 0
    assert cli_main(["send", str(csv_file)]) == 0
    out = capsys.readouterr().out
    assert "sent 2 tickets" in out
    rows = [f for _, f in r.xrange(cli_env.input_stream)]
    assert [f["text"] for f in rows] == ["one", "two", "three, with comma", "four"]
    assert rows[0]["meta"] == '{"a": 1}' and rows[1]["subject"] == "S"
    assert rows[2] == {"text": "three, with comma", "id": "c1", "subject": "Hello", "meta": '{"b": 2}'}
    assert "subject" not in rows[3] and "meta" not in rows[3] and len(rows[3]["id"]) == 32
    assert [json.loads(x)["id"] for x in ids_out.read_text().splitlines()] == ["j1", rows[1]["id"]]


def test_cli_send_rejects_a_file_without_text(cli_env, tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("body\nhello\n", encoding="utf-8")
    assert cli_main(["send", str(bad)]) == 2
    assert "text" in capsys.readouterr().err


def test_cli_synth_out_and_send(cli_env, r, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert cli_main(["synth", "--n", "5", "--seed", "3", "--out", str(out), "--send"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 5 and {"id", "text", "label"} == set(rows[0])
    sent = [f for _, f in r.xrange(cli_env.input_stream)]
    assert [f["id"] for f in sent] == [x["id"] for x in rows]
    assert json.loads(sent[0]["meta"]) == {"synthetic_label": rows[0]["label"]}


def test_cli_results_and_wait(cli_env, r, capsys):
    _classify(r, cli_env, ["k1", "k2"], label="account")
    assert cli_main(["results", "--count", "5"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["id"] for x in lines] == ["k1", "k2"] and lines[0]["label"] == "account" and "result_entry_id" in lines[0]
    assert cli_main(["wait", "k1", "k2", "--timeout-s", "2"]) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == ["k1", "k2"]
    assert cli_main(["wait", "k1", "nope", "--timeout-s", "0.3"]) == 1
    assert "nope" in capsys.readouterr().err


def test_cli_prints_a_result_whose_meta_no_utf8_output_can_hold(cli_env, r, capsys):
    """An older worker echoed meta '{"a": "\\ud800"}' into a result: `results` and `wait` then died with a
    UnicodeEncodeError traceback for everyone reading the stream."""
    pred = Prediction(label="billing", scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    fields = result_fields("s1", pred, latency_ms=1.0, model="m", worker="w", meta='{"a": "\\ud800"}', stream_id="1-0")
    _sink(r, cli_env).write(Outcome(results=[fields]))
    assert cli_main(["results", "--count", "5"]) == 0
    assert cli_main(["wait", "s1", "--timeout-s", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["meta"] for x in lines] == [{"a": "\ud800"}] * 2


def test_cli_backlog_full_exit_code_and_the_ids_of_what_was_sent(cli_env, monkeypatch, tmp_path, capsys):
    """The --ids-out file lists what did go, so ``wait --from-file`` and a resumed send need no guessing."""
    monkeypatch.setenv("TRIAGE_INPUT_MAX_BACKLOG", "1")
    monkeypatch.setenv("TRIAGE_BACKPRESSURE", "refuse")
    f = tmp_path / "t.jsonl"
    f.write_text('{"text": "a", "id": "A"}\n{"text": "b", "id": "B"}\n', encoding="utf-8")
    ids = tmp_path / "ids.jsonl"
    assert cli_main(["send", str(f), "--ids-out", str(ids)]) == 3
    assert "1 sent before that" in capsys.readouterr().err
    assert [json.loads(x)["id"] for x in ids.read_text().splitlines()] == ["A"]


def test_cli_send_refuses_a_file_with_a_ticket_the_worker_would_reject_and_sends_nothing(cli_env, r, tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text('{"text": "a", "id": "A"}\n\n{"text": 5}\n', encoding="utf-8")
    assert cli_main(["send", str(f)]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:3: ticket 2 of the file: ticket text must be a str" in err and "nothing was sent" in err
    assert not r.exists(cli_env.input_stream)


def test_a_wait_longer_than_the_clients_socket_timeout_ends_empty_not_in_a_socket_error(r, settings, redis_url):
    """redis-py 8 gives a plain client a 5 s socket timeout: an XREAD BLOCK past it would raise TimeoutError."""
    plain = redis.Redis.from_url(redis_url, decode_responses=True)
    client = TriageClient(settings.model_copy(update={"wait_poll_max_ms": 6000}), client=plain)
    assert client.wait(["nobody"], timeout_s=6.0) == {}


def test_console_script_runs_as_a_process(triage_env):
    proc = subprocess.run(
        [sys.executable, "-m", "producer", "synth", "--n", "3", "--seed", "1"],
        env=triage_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["id"] for x in proc.stdout.splitlines()] == ["syn-1-000000", "syn-1-000001", "syn-1-000002"]
    bad = subprocess.run(
        [sys.executable, "-m", "producer", "--redis-url", "redis://127.0.0.1:1/0", "backlog"],
        env=triage_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "cannot reach Redis" in bad.stderr


# ---------------------------------------------------------- private redis
def test_private_redis_server_starts_and_stops():
    with local_redis_server() as url:
        assert answers(url)
        redis.Redis.from_url(url).set("k", "v")
    assert not answers(url, 0.3)


def test_demo_redis_falls_back_to_a_private_server(redis_url):
    with demo_redis(None, redis_url, log=lambda m: None) as url:
        assert url == redis_url  # the configured one answers: used as is
    notes: list[str] = []
    with demo_redis(None, "redis://127.0.0.1:1/0", log=notes.append) as url:
        assert url != "redis://127.0.0.1:1/0" and answers(url)
    assert notes and "private redis-server" in notes[0]
    with pytest.raises(RuntimeError, match="no Redis answers"):
        with demo_redis("redis://127.0.0.1:1/0", None):
            pass
    notes.clear()
    with pytest.raises(RuntimeError, match="TRIAGE_REDIS_URL: is not a usable Redis URL") as bad:  # no fallback
        with demo_redis(None, "redis://carol:c@r:ol/P#ss?x=1@127.0.0.1:1/0", log=notes.append):
            pass
    assert notes == [] and "P#ss" not in str(bad.value)


def _answer(r, s, sent, label: str) -> None:
    """What a worker writes for one submission: a result naming its input entry."""
    pred = Prediction(label=label, scores={label: 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    fields = result_fields(sent.ticket_id, pred, latency_ms=1.0, model="m", worker="w", stream_id=sent.stream_id)
    _sink(r, s).write(Outcome(results=[fields]))


def test_wait_matches_the_result_to_the_submission_of_a_resent_id(client, r, settings):
    first = client.submit("charged twice", id="dup")
    _answer(r, settings, first, "billing")
    second = client.submit("app crashes", id="dup")  # the same id, sent again: the key still holds the first answer
    assert client.wait([second], timeout_s=0.3) == {}  # not the earlier answer
    assert client.wait(["dup"], timeout_s=0.3)["dup"].label == "billing"  # a bare id: the latest result, documented
    _answer(r, settings, second, "technical")
    assert client.wait([second], timeout_s=5)["dup"].label == "technical"
    # the key answers the second send now; the first's own result is still found (in the results stream)
    got = client.wait([first], timeout_s=5)["dup"]
    assert got.label == "billing" and got.fields["stream_id"] == first.stream_id


def test_wait_finds_a_finished_submission_whose_result_key_expired(client, r, settings):
    """The key lives TRIAGE_RESULT_TTL_S; a wait after that (a resumed integration, ``wait --from-file`` the next
    day) still gets the result of an entry the group acknowledged, from the results and dead-letter streams."""
    r.xgroup_create(settings.input_stream, GROUP, id="0", mkstream=True)
    done, dead, open_ = (client.submit(t, id=i) for t, i in (("refund", "E-1"), ("x", "E-2"), ("help", "E-3")))
    r.xreadgroup(GROUP, "w", {settings.input_stream: ">"})  # all three delivered
    pred = Prediction(label="billing", scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    ok = result_fields("E-1", pred, latency_ms=1.0, model="m", worker="w", stream_id=done.stream_id)
    bad = dead_letter_fields(
        stream_id=dead.stream_id, reason="bad meta", payload={"id": "E-2", "text": "x"}, deliveries=1, ticket_id="E-2"
    )
    _sink(r, settings).write(Outcome(results=[ok], dead_letters=[bad], ack_ids=[done.stream_id, dead.stream_id]))
    r.delete(client.result_key("E-1"), client.result_key("E-2"))  # expired
    got = client.wait([done, dead, open_], timeout_s=0.5)
    assert got["E-1"].label == "billing" and got["E-1"].fields["stream_id"] == done.stream_id
    assert got["E-2"].status == "dead_letter" and got["E-2"].reason == "bad meta"
    assert "E-3" not in got  # delivered, still pending: nothing to find yet


def test_wait_finds_an_expired_result_written_in_the_same_millisecond_as_its_entry(client, r, settings):
    """Each stream numbers its own ids: a result written in its entry's millisecond can have a lower sequence than
    the entry (results ``5000-0`` for input ``5000-3``). The stream lookup read from after the entry's id and missed
    it (a flaky CI run of the test above, whose submit and write fell in one millisecond)."""
    r.xgroup_create(settings.input_stream, GROUP, id="0", mkstream=True)
    entry = r.xadd(settings.input_stream, {"id": "E-9", "text": "refund"}, id="5000-3")
    r.xreadgroup(GROUP, "w", {settings.input_stream: ">"})
    r.xack(settings.input_stream, GROUP, entry)  # finished, its key expired long ago
    pred = Prediction(label="billing", scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    r.xadd(
        settings.results_stream,
        result_fields("E-9", pred, latency_ms=1.0, model="m", worker="w", stream_id=entry),
        id="5000-0",
    )
    got = client.wait([Submitted("E-9", entry)], timeout_s=0.5)
    assert got["E-9"].label == "billing" and got["E-9"].fields["stream_id"] == entry


def test_cli_wait_from_the_ids_file_of_send(client, r, settings, tmp_path, monkeypatch, redis_url):
    main = cli_main
    for k, v in {
        "TRIAGE_REDIS_URL": redis_url,
        "TRIAGE_INPUT_STREAM": settings.input_stream,
        "TRIAGE_RESULTS_STREAM": settings.results_stream,
        "TRIAGE_DEAD_LETTER_STREAM": settings.dead_letter_stream,
        "TRIAGE_RESULT_KEY_PREFIX": settings.result_key_prefix,
    }.items():
        monkeypatch.setenv(k, v)
    old = client.submit("old", id="T-7")
    _answer(r, settings, old, "billing")
    tickets = tmp_path / "t.jsonl"
    tickets.write_text(json.dumps({"id": "T-7", "text": "new"}) + "\n")
    ids = tmp_path / "ids.jsonl"
    assert main(["send", str(tickets), "--ids-out", str(ids)]) == 0
    assert main(["wait", "--from-file", str(ids), "--timeout-s", "0.3"]) == 1  # the earlier answer does not count
    new = Submitted("T-7", json.loads(ids.read_text())["stream_id"])
    _answer(r, settings, new, "shipping")
    assert main(["wait", "--from-file", str(ids), "--timeout-s", "5"]) == 0


def _write_blank_dead_letter(r, settings, sent) -> None:
    """The worker's dead letter of ``sent``, a ticket "blank" of blank text, written as the worker writes it."""
    dead = dead_letter_fields(
        stream_id=sent.stream_id,
        reason="text is empty",
        payload={"text": " ", "id": "blank"},
        deliveries=1,
        ticket_id="blank",
    )
    _sink(r, settings).write(Outcome(dead_letters=[dead]))


def test_dead_letters_come_back_decoded(client, r, settings):
    sent = client.submit(" ", id="blank")
    _write_blank_dead_letter(r, settings, sent)
    big = client.submit("x" * 500, id="big")
    cut = dead_letter_fields(
        stream_id=big.stream_id,
        reason="text is too long",
        payload={"text": "x" * 500, "id": "big"},
        deliveries=2,
        ticket_id="big",
        excerpt_bytes=100,
    )
    _sink(r, settings).write(Outcome(dead_letters=[cut]))
    rec, rec_cut = client.dead_letters(5)
    assert (
        rec["payload"] == {"text": " ", "id": "blank"} and rec["deliveries"] == 1 and rec["reason"] == "text is empty"
    )
    assert rec["stream_id"] == sent.stream_id and rec["dead_letter_id"]
    # the flag came back as the string "0": truthy, so `if rec["payload_truncated"]` said every payload was cut
    assert rec["payload_truncated"] is False and rec_cut["payload_truncated"] is True
    assert rec_cut["payload_bytes"] == len("text") + 500 + len("id") + len("big") and rec_cut["deliveries"] == 2
    # the CLI's JSON of a dead letter (wait, results) decodes them the same
    waited = client.wait([sent, big], timeout_s=1)
    assert waited["blank"].to_dict()["payload_truncated"] is False
    assert waited["big"].to_dict()["payload_truncated"] is True and waited["big"].to_dict()["payload_bytes"] == 509
