"""The producer as an ACL user with exactly docs/producer.md's line ("Redis ACL"), on this test's keys.

Every operation an integrator runs (send, backlog on each of its paths, wait by id and by ``--ids-out`` file with an
expired key, results, results --follow, dead letters) passes under the line and sends its commands and no other
(PING only with a URL that asks for health checks). Under a narrower line the CLI says which command was refused,
on which key, in one line, and exits 2: a refused XINFO GROUPS read as "no such stream" (backlog 0, backpressure
off), and a key outside the user's patterns was refused in words that name neither the command nor the key.
Real Redis; users with unique names, deleted afterwards.
"""

from __future__ import annotations

import json
import time

import pytest
import redis

from producer import ProducerSettings, Submitted, TriageClient
from producer.cli import main as cli_main
from producer.redis_errors import AclRefused
from tests.acl_lines import PRODUCER_DOC, Sent, acl_user, commands_of, documented_rules, on_keys
from tests.integration.test_producer import GROUP, _sink
from worker.engine.classifier import Prediction
from worker.stream.records import dead_letter_fields, result_fields
from worker.stream.sink import Outcome

USER = "triage-producer"


@pytest.fixture
def rules(key_prefix) -> list[str]:
    return on_keys(documented_rules(PRODUCER_DOC, USER), key_prefix)


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
def r(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _as(monkeypatch, settings: ProducerSettings, url: str) -> None:
    """The CLI's environment: the test's keys, logged in as ``url``'s user."""
    monkeypatch.setenv("TRIAGE_REDIS_URL", url)
    for name in ("input_stream", "results_stream", "dead_letter_stream", "result_key_prefix", "group"):
        monkeypatch.setenv(f"TRIAGE_{name.upper()}", str(getattr(settings, name)))


def _tickets(path, ids) -> str:
    path.write_text("".join(json.dumps({"id": t, "text": f"ticket {t}"}) + "\n" for t in ids))
    return str(path)


def _settle(r, s: ProducerSettings, sent: list[Submitted]) -> None:
    """A worker's writes for ``sent`` (delivered first): results, a dead letter for the second, acked."""
    r.xreadgroup(GROUP, "w", {s.input_stream: ">"})
    pred = Prediction(label="billing", scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=7)
    ok = [
        result_fields(x.ticket_id, pred, latency_ms=1.0, model="m", worker="w", stream_id=x.stream_id)
        for i, x in enumerate(sent)
        if i != 1
    ]
    bad = dead_letter_fields(
        stream_id=sent[1].stream_id, reason="bad meta", payload={"id": sent[1].ticket_id}, deliveries=1,
        ticket_id=sent[1].ticket_id,
    )  # fmt: skip
    _sink(r, s).write(Outcome(results=ok, dead_letters=[bad], ack_ids=[x.stream_id for x in sent]))


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_every_integrator_operation_runs_under_the_documented_line(
    rules, settings, r, redis_url, tmp_path, monkeypatch, capsys
):
    ids = tmp_path / "ids.jsonl"
    with acl_user(redis_url, rules) as (name, url):
        sent = Sent(monkeypatch, name)
        _as(monkeypatch, settings, url)
        assert cli_main(["backlog"]) == 0  # no stream yet: XINFO GROUPS answers "no such key"
        assert capsys.readouterr().out.startswith("0 tickets waiting")
        assert cli_main(["send", _tickets(tmp_path / "t.jsonl", ["A-1", "A-2", "A-3"]), "--ids-out", str(ids)]) == 0
        assert "sent 3 tickets" in capsys.readouterr().out and r.xlen(settings.input_stream) == 3
        assert cli_main(["backlog"]) == 0  # no group yet: XLEN
        assert capsys.readouterr().out.startswith("3 tickets waiting")
        r.xgroup_create(settings.input_stream, GROUP, id="0")
        r.xdel(settings.input_stream, r.xadd(settings.input_stream, {"text": "x"}))  # Redis cannot tell the lag now
        assert r.xinfo_groups(settings.input_stream)[0]["lag"] is None
        assert cli_main(["backlog"]) == 0  # XRANGE after the last delivered entry
        assert capsys.readouterr().out.startswith("3 tickets waiting")

        submitted = [Submitted(row["id"], row["stream_id"]) for row in _lines(ids.read_text())]
        _settle(r, settings, submitted)
        r.delete(settings.result_key_prefix + "A-1")  # expired: found in the results stream (XPENDING, XRANGE)
        assert cli_main(["wait", "--from-file", str(ids), "--timeout-s", "5"]) == 0
        got = {x["id"]: x for x in _lines(capsys.readouterr().out)}
        assert got["A-1"]["label"] == "billing" and got["A-1"]["stream_id"] == submitted[0].stream_id
        assert got["A-2"]["status"] == "dead_letter" and got["A-2"]["reason"] == "bad meta"
        assert got["A-3"]["label"] == "billing"
        assert cli_main(["wait", "A-3", "--timeout-s", "5"]) == 0  # a plain id: its key (MGET)
        assert [x["id"] for x in _lines(capsys.readouterr().out)] == ["A-3"]
        assert cli_main(["results", "--count", "5"]) == 0
        assert sorted(x["id"] for x in _lines(capsys.readouterr().out)) == ["A-1", "A-2", "A-3"]
        assert cli_main(["results", "--follow", "--since", "0", "--count", "3"]) == 0  # XREAD
        assert sorted(x["id"] for x in _lines(capsys.readouterr().out)) == ["A-1", "A-2", "A-3"]
        client = TriageClient(settings.model_copy(update={"redis_url": url}))
        (dead,) = client.dead_letters(5)
        assert dead["reason"] == "bad meta" and dead["stream_id"] == submitted[1].stream_id
        # what the client sent is what the line grants; PING only where a URL asks for it (the next test)
        assert sent.commands == commands_of(rules) - {"PING"}


def test_a_client_that_checks_idle_connections_pings_and_the_line_allows_it(rules, settings, redis_url, monkeypatch):
    """``?health_check_interval=1`` (or a client passed in with it): redis-py PINGs a connection idle 1 s before
    using it, and a refused PING fails the call after it: the reason the line has ``+ping``."""
    with acl_user(redis_url, rules) as (name, url):
        sent = Sent(monkeypatch, name)
        client = TriageClient(settings.model_copy(update={"redis_url": url + "?health_check_interval=1"}))
        assert client.backlog() == 0
        time.sleep(1.2)  # idle past the interval: not a timing assertion, what makes redis-py check the connection
        assert client.backlog() == 0
        assert "PING" in sent.commands


def _case_send_nothing(cli, r, s, tmp_path):
    return cli(["send", _tickets(tmp_path / "t.jsonl", ["B-1", "B-2"])])


def _case_backlog_before_a_group(cli, r, s, tmp_path):
    r.xadd(s.input_stream, {"id": "B-0", "text": "x"})
    return cli(["backlog"])


def _case_backlog_without_lag(cli, r, s, tmp_path):
    r.xadd(s.input_stream, {"id": "B-0", "text": "x"})
    r.xgroup_create(s.input_stream, GROUP, id="0")
    r.xdel(s.input_stream, r.xadd(s.input_stream, {"text": "x"}))
    return cli(["backlog"])


def _case_wait_from_file(cli, r, s, tmp_path):
    """A finished submission whose key expired: its result is looked for in the streams."""
    r.xgroup_create(s.input_stream, GROUP, id="0", mkstream=True)
    entry = r.xadd(s.input_stream, {"id": "B-1", "text": "x"})
    r.xreadgroup(GROUP, "w", {s.input_stream: ">"})
    r.xack(s.input_stream, GROUP, entry)
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"id": "B-1", "stream_id": entry}) + "\n")
    return cli(["wait", "--from-file", str(ids), "--timeout-s", "1"])


def _case_wait(cli, r, s, tmp_path):
    return cli(["wait", "B-1", "--timeout-s", "1"])


def _case_results(cli, r, s, tmp_path):
    return cli(["results"])


def _case_follow(cli, r, s, tmp_path):
    return cli(["results", "--follow", "--since", "0", "--count", "1"])


@pytest.mark.parametrize(
    ("narrower", "case", "refused"),
    [
        ("-xinfo|groups", _case_send_nothing, "XINFO GROUPS on {p}tickets"),  # sent with no backpressure before
        ("-xinfo|groups", _case_wait_from_file, "XINFO GROUPS on {p}tickets"),  # timed out, never looked
        ("-xadd", _case_send_nothing, "XADD on {p}tickets"),
        ("-xlen", _case_backlog_before_a_group, "XLEN on {p}tickets"),
        ("-xrange", _case_backlog_without_lag, "XRANGE on {p}tickets"),
        ("-xpending", _case_wait_from_file, "XPENDING on {p}tickets"),
        ("-mget", _case_wait, "MGET on {p}result:*"),
        ("-xrevrange", _case_results, "XREVRANGE on {p}results"),
        ("-xread", _case_follow, "XREAD on {p}results, {p}dead"),
        # a key outside the user's patterns: Redis's words name neither the command nor the key
        ("resetkeys ~{p}tickets %R~{p}results %R~{p}dead", _case_wait, "MGET on {p}result:*"),
    ],
)
def test_a_narrower_line_is_one_line_naming_the_refused_command_and_exit_2(
    rules, settings, r, redis_url, key_prefix, tmp_path, monkeypatch, capsys, narrower, case, refused
):
    with acl_user(redis_url, rules + narrower.format(p=key_prefix).split()) as (_, url):
        _as(monkeypatch, settings, url)
        assert case(cli_main, r, settings, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("triage-producer "), err
    assert f"may not run {refused.format(p=key_prefix)} (" in err and "docs/producer.md" in err, err
    assert "Traceback" not in err and "acl-lines-pw" not in err


def test_the_client_raises_a_refused_xinfo_instead_of_reading_it_as_no_stream(rules, settings, r, redis_url):
    """``backlog()`` said 0 and ``submit_many`` sent past any limit; ``wait`` never looked up an expired result."""
    r.xadd(settings.input_stream, {"id": "C-0", "text": "x"})
    with acl_user(redis_url, [*rules, "-xinfo|groups"]) as (_, url):
        client = TriageClient(settings.model_copy(update={"redis_url": url, "input_max_backlog": 1}))
        with pytest.raises(AclRefused) as refused:
            client.backlog()
        assert (refused.value.command, refused.value.keys) == ("XINFO GROUPS", settings.input_stream)
        assert isinstance(refused.value, redis.exceptions.NoPermissionError)
        with pytest.raises(AclRefused) as refused:
            client.submit_many(["charged twice"])
        assert refused.value.submitted == [] and r.xlen(settings.input_stream) == 1  # over the limit: nothing sent


def test_a_database_the_line_cannot_select_is_named_as_select_with_the_documented_fix(
    rules, settings, redis_url, monkeypatch, capsys
):
    """redis-py SELECTs a URL's database on connecting; refused, Redis names ``select`` on the first call's reply and
    the CLI blamed that call ("may not run XINFO GROUPS"), pointing at a line that already grants it."""
    with acl_user(redis_url, rules) as (_name, url):
        _as(monkeypatch, settings, url.rsplit("/", 1)[0] + "/1")
        assert cli_main(["backlog"]) == 2
        err = capsys.readouterr().err
        assert "may not run SELECT (sent on connecting, before XINFO GROUPS on " in err, err
        with acl_user(redis_url, [*rules, "+select"]) as (_name2, url2):  # the docs' advice for another database
            _as(monkeypatch, settings, url2.rsplit("/", 1)[0] + "/1")
            assert cli_main(["backlog"]) == 0, capsys.readouterr().err
    assert "+select" in PRODUCER_DOC.read_text(encoding="utf-8")
