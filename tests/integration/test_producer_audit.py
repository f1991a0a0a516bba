"""Three producer bugs an audit found, each failing before its fix: a stream setting naming a key of another type
(``backlog`` said 0 and exited 0; the other commands ended in a bare WRONGTYPE "Redis error", exit 1, or waited
out their timeout), ``repr()`` of ``ProducerSettings`` printing the Redis password, and a CSV quote that nothing
closes sent as one ticket of every line after it. Real Redis under a unique key prefix; real CLI processes.
"""

from __future__ import annotations

import json
import os

import pytest
import redis

from producer import ProducerSettings, TriageClient, WrongType
from tests.acl_lines import PRODUCER_DOC, acl_user, documented_rules, on_keys
from tests.worker_proc import run_clis
from worker.settings import Settings

STREAM_VARS = {
    "TRIAGE_INPUT_STREAM": "tickets",
    "TRIAGE_RESULTS_STREAM": "results",
    "TRIAGE_DEAD_LETTER_STREAM": "dead",
}


@pytest.fixture
def r(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def env(redis_url, key_prefix) -> dict[str, str]:
    """A producer process's environment on this test's keys."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRIAGE_")}
    return {
        **base,
        "TRIAGE_REDIS_URL": redis_url,
        **{var: key_prefix + name for var, name in STREAM_VARS.items()},
        "TRIAGE_RESULT_KEY_PREFIX": key_prefix + "result:",
    }


def _string_at(r: redis.Redis, env: dict[str, str], var: str, *, own_key: bool = False) -> dict[str, str]:
    """``env`` with ``var``'s stream a string key (``SET <key> hello``): one beside it, or (``own_key``) its own."""
    key = env[var] if own_key else env[var] + ":a-string"
    r.set(key, "hello")
    return {**env, var: key}


def _wrong_line(command: str, var: str, key: str) -> str:
    return (
        f"triage-producer {command}: {var}: the key {key!r} holds a Redis string, not a stream; rename it or point "
        f"{var} elsewhere"
    )


# ------------------------------------------------------- a stream setting naming a key of another type
def test_every_command_refuses_a_stream_setting_that_names_a_key_of_another_type(r, env, tmp_path):
    tickets = tmp_path / "t.jsonl"
    tickets.write_text('{"id": "T-1", "text": "refund please"}\n', encoding="utf-8")
    sent = tmp_path / "sent.jsonl"
    sent.write_text(json.dumps({"id": "T-9", "stream_id": "1-0"}) + "\n", encoding="utf-8")
    bad_input = _string_at(r, env, "TRIAGE_INPUT_STREAM")
    bad_results = _string_at(r, env, "TRIAGE_RESULTS_STREAM")
    bad_dead = _string_at(r, env, "TRIAGE_DEAD_LETTER_STREAM")
    send = ["producer", "send", str(tickets)]
    runs = {  # (the command, the setting it names, what it adds): (env, argv)
        ("backlog", "TRIAGE_INPUT_STREAM", ""): (bad_input, ["producer", "backlog"]),
        ("send", "TRIAGE_INPUT_STREAM", "; nothing was sent"): (bad_input, send),
        ("send", "TRIAGE_INPUT_STREAM", "; nothing was sent", "no backlog limit"): (
            {**bad_input, "TRIAGE_INPUT_MAX_BACKLOG": "0"},  # no backlog check first: the XADDs meet it
            send,
        ),
        ("synth", "TRIAGE_INPUT_STREAM", "; nothing was sent"): (bad_input, ["producer", "synth", "--send"]),
        ("send", "TRIAGE_RESULTS_STREAM", "; nothing was sent"): (bad_results, [*send, "--wait-s", "5"]),
        ("results", "TRIAGE_RESULTS_STREAM", ""): (bad_results, ["producer", "results"]),
        ("results", "TRIAGE_DEAD_LETTER_STREAM", ""): (bad_dead, ["producer", "results", "--count", "3"]),
        ("results", "TRIAGE_DEAD_LETTER_STREAM", "", "follow"): (
            bad_dead,
            ["producer", "results", "--follow", "--since", "0", "--count", "1"],
        ),
        ("wait", "TRIAGE_RESULTS_STREAM", ""): (bad_results, ["producer", "wait", "T-1", "--timeout-s", "5"]),
        ("wait", "TRIAGE_INPUT_STREAM", ""): (  # a submission without a result key: looked up via the input group
            bad_input,
            ["producer", "wait", "--from-file", str(sent), "--timeout-s", "5"],
        ),
    }
    done = run_clis(runs)
    for key, (run_env, _argv) in runs.items():
        (command, var, tail), p = key[:3], done[key]
        assert (p.returncode, p.stderr) == (2, _wrong_line(command, var, run_env[var]) + tail + "\n"), (runs, p)
    for run_env, _ in runs.values():  # nothing was sent anywhere
        assert not r.exists(run_env["TRIAGE_INPUT_STREAM"]) or r.type(run_env["TRIAGE_INPUT_STREAM"]) == "string"
    assert r.get(bad_input["TRIAGE_INPUT_STREAM"]) == "hello"


def test_results_without_dead_letters_does_not_read_the_dead_letter_stream(r, env):
    """The refusal is of the keys a command uses: ``--no-dead-letters`` never reads TRIAGE_DEAD_LETTER_STREAM."""
    bad_dead = _string_at(r, env, "TRIAGE_DEAD_LETTER_STREAM")
    done = run_clis({0: (bad_dead, ["producer", "results", "--no-dead-letters"])})
    assert (done[0].returncode, done[0].stdout, done[0].stderr) == (0, "", "")


def test_as_the_documented_acl_user_the_line_names_the_setting_without_the_type(r, env, redis_url, key_prefix):
    """The producer's ACL line grants no TYPE: the line then says "another Redis type" (still exit 2, the setting)."""
    rules = on_keys(documented_rules(PRODUCER_DOC, "triage-producer"), key_prefix)
    bad = _string_at(r, env, "TRIAGE_INPUT_STREAM", own_key=True)  # a key the line grants
    with acl_user(redis_url, rules) as (_name, url):
        done = run_clis({0: ({**bad, "TRIAGE_REDIS_URL": url}, ["producer", "backlog"])})
    key = bad["TRIAGE_INPUT_STREAM"]
    assert (done[0].returncode, done[0].stderr) == (
        2,
        f"triage-producer backlog: TRIAGE_INPUT_STREAM: the key {key!r} holds another Redis type than a stream; "
        "rename it or point TRIAGE_INPUT_STREAM elsewhere\n",
    )


def test_the_client_backlog_raises_wrong_type_instead_of_reading_zero(r, redis_url, key_prefix):
    r.set(key_prefix + "tickets", "hello")
    client = TriageClient(ProducerSettings(redis_url=redis_url, input_stream=key_prefix + "tickets"))
    with pytest.raises(WrongType) as raised:
        client.backlog()
    assert isinstance(raised.value, redis.ResponseError)
    assert (raised.value.command, raised.value.keys) == ("XINFO GROUPS", key_prefix + "tickets")


def test_backlog_on_a_database_that_does_not_exist_is_an_error_not_zero(redis_url, key_prefix):
    """XINFO GROUPS' "no such key" is an empty backlog; any other refusal (SELECT of a db the server lacks, on
    connect) was read as one too: backpressure off, `backlog` said 0 and exit 0."""
    client = TriageClient(ProducerSettings(redis_url=redis_url.rsplit("/", 1)[0] + "/999", input_stream=key_prefix))
    with pytest.raises(redis.ResponseError, match="DB index"):
        client.backlog()


@pytest.mark.parametrize(
    "url, pieces",
    [
        ("redis://user:Secret9/x@127.0.0.1:6379/0", ["Secret9"]),
        # a space or a quote in it too: the URL shapes stop there (a review: the whole password was printed)
        ("redis://:my pass/word@127.0.0.1:6379/0", ["my pass", "word@"]),
        ("redis://default:it's/secret@127.0.0.1:6379/0", ["it's", "secret"]),
    ],
)
def test_a_url_the_client_cannot_parse_is_refused_without_its_password(url, pieces):
    """redis-py's own message named a piece of the password ("Port could not be cast to integer value as
    'Secret9'"): an unencoded "/" in the password ends the host part early."""
    with pytest.raises(ValueError) as raised:
        TriageClient(ProducerSettings(redis_url=url))
    assert "TRIAGE_REDIS_URL" in str(raised.value)
    assert not [p for p in pieces if p in str(raised.value)], str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


# ------------------------------------------------------------------- repr of the settings
@pytest.mark.parametrize(
    "url, secret",
    [
        ("redis://triage:S3cretPW-u@127.0.0.1:6379/0", "S3cretPW-u"),
        ("rediss://:S3cretPW-e@redis.example:6380/0", "S3cretPW-e"),
        ("redis://127.0.0.1:6379/0?password=S3cretPW-q", "S3cretPW-q"),
        # what the URL shapes miss: a space or a quote in the password, an unencoded "?x=" in it, an encoded "="
        ("redis://quser:it's Secret99@127.0.0.1:6379/0", "it's Secret99"),
        ("redis://user:Xy7?a=Bc9@127.0.0.1:6379/0", "Xy7?a=Bc9"),
        ("redis://127.0.0.1:6379/0?username=u&password%3DS3cretPW-d", "S3cretPW-d"),
    ],
)
@pytest.mark.parametrize("settings_cls", [ProducerSettings, Settings])
def test_repr_and_str_of_the_settings_mask_the_redis_password(url, secret, settings_cls):
    s = settings_cls(redis_url=url)
    for shown in (repr(s), str(s), f"{s!r}", "%s" % (s,)):  # noqa: UP031 - as a logging call formats it
        assert secret not in shown and "***" in shown and "redis_url=" in shown, shown
    assert s.redis_url == url and s.model_dump()["redis_url"] == url  # the value itself is not touched


# ------------------------------------------------------------------- a CSV quote nothing closes
@pytest.mark.parametrize(
    "content, opens_on",
    [
        ('id,text\nc0,fine\nc1,"unterminated text\n', 3),  # the audit's file
        ('id,text\nc0,fine\nc1,"unterminated text', 3),  # no line break at the end
        ('text,id\n"two\nlines",A-1\nquote "inside" is fine,A-2\n"a\nb","c\nA-4, d\n', 6),  # the field's line
        ('id,text\r\nc0,fine\r\nc1,"runs on\r\nc2,over the rest\r\nc3,of the file\r\n', 3),  # swallows three rows
    ],
)
def test_send_refuses_a_csv_whose_quote_never_closes_and_sends_nothing(r, env, tmp_path, content, opens_on):
    f = tmp_path / "t.csv"
    f.write_bytes(content.encode("utf-8"))
    done = run_clis({0: (env, ["producer", "send", str(f)])})
    p = done[0]
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr.startswith(f"triage-producer send: {f}:{opens_on}: unreadable CSV: a quoted field opens on"), p
    assert "no quote closes it" in p.stderr and p.stderr.count("\n") == 1, p.stderr  # one line
    assert not r.exists(env["TRIAGE_INPUT_STREAM"])


def test_a_csv_whose_quotes_all_close_is_sent_as_before(r, env, tmp_path):
    f = tmp_path / "t.csv"
    f.write_text('id,text\nc0,"two\nlines"\nc1,"said ""hi"""', encoding="utf-8")  # the last one ends the file
    cut = tmp_path / "cut.csv"  # --limit stops before the open quote: the rows sent are whole
    cut.write_text('id,text\nk0,fine\nk1,"never closed\n', encoding="utf-8")
    done = run_clis({0: (env, ["producer", "send", str(f)]), 1: (env, ["producer", "send", str(cut), "--limit", "1"])})
    assert [p.returncode for p in done.values()] == [0, 0], done
    got = [fields for _, fields in r.xrange(env["TRIAGE_INPUT_STREAM"])]
    assert sorted((g["id"], g["text"]) for g in got) == [("c0", "two\nlines"), ("c1", 'said "hi"'), ("k0", "fine")]
