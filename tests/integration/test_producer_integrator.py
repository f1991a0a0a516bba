"""The producer as an integrator drives it: files it cannot read, paths it cannot write, Ctrl-C part-way, and
one ticket passed where the API wants many. Each test failed before its fix (a traceback, a ticket sent that
should not have been, ids lost, a silent wait on the characters of an id). Real Redis under a unique prefix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from producer import ProducerSettings, TriageClient
from producer.cli import main as cli_main
from tests.integration.test_producer import _records_at
from tests.worker_proc import REPO
from worker.redis_server import free_port


@pytest.fixture
def settings(redis_url, key_prefix) -> ProducerSettings:
    return ProducerSettings(
        redis_url=redis_url,
        input_stream=key_prefix + "tickets",
        results_stream=key_prefix + "results",
        dead_letter_stream=key_prefix + "dead",
        result_key_prefix=key_prefix + "result:",
    )


@pytest.fixture
def r(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def cli_env(monkeypatch, settings):
    for name in ("redis_url", "input_stream", "results_stream", "dead_letter_stream", "result_key_prefix"):
        monkeypatch.setenv(f"TRIAGE_{name.upper()}", str(getattr(settings, name)))
    return settings


def _tickets(path, n: int):
    path.write_text("".join(json.dumps({"id": f"T-{i}", "text": f"ticket {i}"}) + "\n" for i in range(n)))
    return path


def test_cli_send_refuses_a_file_it_cannot_decode_with_exit_2(cli_env, r, tmp_path, capsys):
    """A Latin-1 export and a CSV field over the csv module's limit (128 KiB) ended in a traceback and exit 1."""
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "caf\xe9"}\n')
    big = tmp_path / "big.csv"
    big.write_text('text,id\n"two\nlines",A-1\n"' + "a" * 200_000 + '",B-1\n', encoding="utf-8")
    assert cli_main(["send", str(latin1)]) == 2
    assert "latin1.jsonl: not UTF-8 text" in capsys.readouterr().err
    assert cli_main(["send", str(big)]) == 2
    assert "big.csv:4: unreadable CSV: field larger than field limit" in capsys.readouterr().err  # its row's line
    assert not r.exists(cli_env.input_stream)


def test_cli_send_checks_the_ids_out_path_before_sending(cli_env, r, tmp_path, capsys):
    """The ids file was opened after the send: a bad path sent the tickets, then raised, and lost their ids."""
    tickets = _tickets(tmp_path / "t.jsonl", 2)
    assert cli_main(["send", str(tickets), "--ids-out", str(tmp_path / "no" / "such" / "ids.jsonl")]) == 2
    assert "--ids-out" in capsys.readouterr().err
    assert not r.exists(cli_env.input_stream)


def test_a_send_refused_before_anything_went_leaves_an_earlier_ids_file_as_it_was(
    cli_env, r, tmp_path, capsys, monkeypatch
):
    """Opening ``--ids-out`` before the send must not empty it: a later send of a file with a bad row, or one that
    finds Redis unreachable (nothing sent), would lose the ids of the earlier send that the file still holds. A send
    that goes replaces it."""
    ids = tmp_path / "ids.jsonl"
    assert cli_main(["send", str(_tickets(tmp_path / "a.jsonl", 2)), "--ids-out", str(ids)]) == 0
    first = ids.read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "B-1", "text": "fine"}) + "\n" + json.dumps({"id": "B-\u0007", "text": "fine"}) + "\n"
    )
    assert cli_main(["send", str(bad), "--ids-out", str(ids)]) == 2
    assert "bad.jsonl:2: ticket 2 of the file" in capsys.readouterr().err
    assert ids.read_text() == first and len(first.splitlines()) == 2
    monkeypatch.setenv("TRIAGE_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")  # nothing answers: nothing goes
    assert cli_main(["send", str(_tickets(tmp_path / "b.jsonl", 2)), "--ids-out", str(ids)]) == 1
    assert "0 tickets sent" in capsys.readouterr().err
    assert ids.read_text() == first
    monkeypatch.setenv("TRIAGE_REDIS_URL", cli_env.redis_url)
    assert cli_main(["send", str(_tickets(tmp_path / "c.jsonl", 1)), "--ids-out", str(ids)]) == 0
    assert [json.loads(x)["stream_id"] for x in ids.read_text().splitlines()] == [
        r.xrevrange(cli_env.input_stream)[0][0]
    ]


@pytest.mark.parametrize(
    "name, content, where, why",
    [
        # blank lines: the 2nd ticket is on line 4 (it was reported as "row 2")
        (
            "t.jsonl",
            '{"text": "a", "id": "A"}\n\n\n{"text": "b", "id": "B-\\u0007"}\n',
            "t.jsonl:4: ticket 2 of the file",
            "id contains control characters",
        ),
        # a quoted field over three lines and a blank line: the 2nd ticket starts on line 6
        ("t.csv", 'text,id\n"line one\nline two\nline three",A-1\n\nfine,"  "\n', "t.csv:6: ticket 2", "id is empty"),
    ],
)
def test_cli_send_names_the_file_line_of_a_bad_ticket(cli_env, r, tmp_path, capsys, name, content, where, why):
    """The reason named the ticket's position among the parsed rows, which is not the line an editor shows once a
    file has blank lines or a CSV field holds newlines."""
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert cli_main(["send", str(path)]) == 2
    err = capsys.readouterr().err
    assert where in err and why in err and "nothing was sent" in err, err
    assert not r.exists(cli_env.input_stream)


@pytest.mark.parametrize(
    "given, kind",
    [('{"crm": 7}', "a dict (a JSON object)"), ('["T-1"]', "a list (a JSON array)"), ("true", "a boolean")],
)
def test_cli_send_refuses_an_id_that_is_no_string_or_number(cli_env, r, tmp_path, capsys, given, kind):
    """A JSON object id was sent as the Python text "{'crm': 7}": an id nobody gave, in a result nobody can match.
    Now the file is refused (exit 2) at the line of that ticket, nothing sent; a number id is its text, as before."""
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"text": "a", "id": 7}}\n{{"text": "b", "id": {given}}}\n', encoding="utf-8")
    assert cli_main(["send", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"t.jsonl:2: ticket 2 of the file: id must be a string or a number, got {kind}" in err, err
    assert not r.exists(cli_env.input_stream)
    path.write_text('{"text": "a", "id": 7}\n', encoding="utf-8")
    assert cli_main(["send", str(path)]) == 0
    assert [f["id"] for _, f in r.xrange(cli_env.input_stream)] == ["7"]


def test_cli_results_prints_dead_letters_marked_and_can_leave_them_out(cli_env, r, capsys):
    """``results`` and ``results --follow`` printed the results stream only: a ticket that failed never showed.
    Each dead letter is a line with ``"status": "dead_letter"`` and its reason, in entry order with the results."""
    _records_at(r, cli_env)  # results F-1, F-3; dead letters F-2, F-4
    for sid, tid in (("5000-0", "F-5"), ("6000-0", "F-6")):  # more results: a follow that skips dead letters ends too
        r.xadd(cli_env.results_stream, {"id": tid, "label": "billing", "score": "0.9", "stream_id": "1-0"}, id=sid)

    def ids(*argv) -> list[str]:
        assert cli_main(["results", *argv]) == 0
        return [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]

    assert cli_main(["results", "--follow", "--since", "0", "--count", "4"]) == 0
    followed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["id"], x["status"], x.get("reason")) for x in followed] == [
        ("F-1", "ok", None),
        ("F-2", "dead_letter", "bad F-2"),
        ("F-3", "ok", None),
        ("F-4", "dead_letter", "bad F-4"),
    ]
    assert followed[1]["payload"] == {"id": "F-2", "text": ""} and followed[1]["payload_truncated"] is False
    assert ids("--follow", "--since", "2500-0", "--count", "2") == ["F-3", "F-4"]
    assert ids("--follow", "--since", "0", "--count", "3", "--no-dead-letters") == ["F-1", "F-3", "F-5"]
    assert ids("--count", "3") == ["F-4", "F-5", "F-6"]
    assert ids("--count", "3", "--no-dead-letters") == ["F-3", "F-5", "F-6"]
    with pytest.raises(SystemExit) as stop:  # a usage error, not a Redis error after connecting
        cli_main(["results", "--follow", "--since", "yesterday"])
    assert stop.value.code == 2 and "entry id" in capsys.readouterr().err


def test_cli_counts_below_their_floor_are_usage_errors(cli_env, r, tmp_path, capsys):
    """``send --limit 0`` (or -1) sent one ticket; ``synth``/``demo --n -1`` raised ValueError; ``results --count 0``
    printed 20."""
    tickets = _tickets(tmp_path / "t.jsonl", 2)
    for argv in (
        ["send", str(tickets), "--limit", "0"],
        ["synth", "--n", "-1"],
        ["demo", "--n", "-1"],
        ["results", "--count", "0"],
    ):
        with pytest.raises(SystemExit) as stop:
            cli_main(argv)
        assert stop.value.code == 2, argv
        assert "must be at least" in capsys.readouterr().err
    assert not r.exists(cli_env.input_stream)
    assert cli_main(["send", str(tickets), "--limit", "1"]) == 0 and r.xlen(cli_env.input_stream) == 1


def test_cli_wait_on_an_empty_ids_file_waits_for_nothing(cli_env, tmp_path, capsys):
    """`send` of an empty file writes an empty --ids-out file and exits 0; waiting on it exited 2, "give ticket ids
    or --from-file", although it was given."""
    empty, ids = tmp_path / "empty.jsonl", tmp_path / "ids.jsonl"
    empty.write_text("")
    assert cli_main(["send", str(empty), "--ids-out", str(ids)]) == 0
    assert cli_main(["wait", "--from-file", str(ids), "--timeout-s", "0"]) == 0
    capsys.readouterr()
    assert cli_main(["wait"]) == 2 and "give ticket ids" in capsys.readouterr().err


def test_one_ticket_where_the_api_takes_many_is_refused(settings, r):
    """A str is an iterable of characters and a dict one of its keys: ``submit_many({"text": ...})`` sent "text" as
    a ticket, ``submit_many("abc")`` three, and ``wait("T-1")`` waited out its timeout on "T", "-" and "1"."""
    client = TriageClient(settings)
    sent = client.submit("charged twice", id="T-1")
    for call in (
        lambda: client.submit_many({"text": "charged twice"}),
        lambda: client.submit_many("abc"),
        lambda: client.wait("T-1", timeout_s=0),
        lambda: client.get_results("T-1"),
    ):
        with pytest.raises(TypeError, match="got a single"):
            call()
    assert r.xlen(settings.input_stream) == 1
    assert client.wait([sent, "T-1"], timeout_s=0) == {}  # lists, generators and Submitted work as before
    assert client.submit_many(t for t in ["a", "b"])[1].ticket_id


def test_ctrl_c_during_a_blocked_send_writes_the_ids_of_what_went(cli_env, r, tmp_path):
    """``send`` blocked by backpressure (``block``: a batch import) and stopped with Ctrl-C printed a traceback and
    wrote no --ids-out file, so a resume could not tell what had gone. Now: exit 130, one line, the ids."""
    tickets, ids = _tickets(tmp_path / "t.jsonl", 30), tmp_path / "ids.jsonl"
    name = f"send-{cli_env.input_stream}"  # to find this process's connection in CLIENT LIST
    env = dict(
        os.environ,  # with cli_env's TRIAGE_* names
        TRIAGE_REDIS_URL=f"{cli_env.redis_url}?client_name={name}",
        TRIAGE_INPUT_MAX_BACKLOG="10",  # no worker: two chunks of 5 go, the third waits for room
        TRIAGE_SUBMIT_CHUNK_SIZE="5",
        TRIAGE_BACKPRESSURE_TIMEOUT_S="300",
    )
    argv = [sys.executable, "-m", "producer", "send", str(tickets), "--ids-out", str(ids)]
    # SIGINT as a terminal leaves it: a shell running the suite in the background (no job control) hands its
    # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

    def waiting_for_room() -> bool:  # both chunks in and their replies read: it is back to checking the backlog
        conns = [c for c in r.client_list() if c.get("name") == name]
        return r.xlen(cli_env.input_stream) == 10 and any(c["cmd"] in ("xlen", "xinfo|groups") for c in conns)

    try:
        deadline = time.monotonic() + 120
        while not waiting_for_room():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"send never blocked on the backlog: {proc.communicate()[1]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted (10 tickets sent before that)" in err
    written = [json.loads(line) for line in ids.read_text().splitlines()]
    assert written == [{"id": f["id"], "stream_id": sid} for sid, f in r.xrange(cli_env.input_stream)]


def test_a_redis_url_after_the_command_is_taken_and_argparse_never_echoes_a_password(cli_env, r, capsys, monkeypatch):
    """``backlog --redis-url URL`` was an argparse error that printed the URL, password and all; so was any usage
    error of triage-worker or triage-bench naming such a URL."""
    from worker.bench.cli import main as bench_main
    from worker.cli import main as worker_main

    r.xadd(cli_env.input_stream, {"text": "x"})
    monkeypatch.setenv("TRIAGE_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens: the flag must win
    assert cli_main(["backlog", "--redis-url", cli_env.redis_url]) == 0  # after the command: overrides the env
    assert capsys.readouterr().out.startswith("1 tickets waiting")
    secret = "redis://u:S3cretPW@127.0.0.1:6379/0"
    for main, argv in (
        (cli_main, ["backlog", "--bogus", secret]),
        (worker_main, ["status", "--redis-url", secret]),
        (bench_main, ["--bogus", secret]),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "unrecognized arguments" in err, (argv, err)
        assert "S3cretPW" not in err and "redis://u:***@127.0.0.1" in err, err


def test_ids_out_to_a_pipe_gets_the_ids(cli_env, r, tmp_path):
    """``--ids-out /dev/stdout | ...`` sent the tickets, then failed rewinding the pipe: a traceback, exit 1 and the
    ids lost (a retry sent every ticket twice)."""
    tickets = _tickets(tmp_path / "t.jsonl", 3)
    argv = [sys.executable, "-m", "producer", "send", str(tickets), "--ids-out", "/dev/stdout"]
    p = subprocess.run(argv, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert rows == [{"id": f["id"], "stream_id": sid} for sid, f in r.xrange(cli_env.input_stream)]


def test_wait_refuses_a_timeout_that_is_not_a_finite_number_and_the_client_waits_without_one(
    cli_env, settings, r, capsys
):
    """``wait --timeout-s inf`` (or ``nan``) ended in a traceback (``int(inf)``); the client's ``wait`` likewise."""
    for argv in (
        ["wait", "X-1", "--timeout-s", "inf"],
        ["wait", "X-1", "--timeout-s", "nan"],
        ["send", "f", "--wait-s", "-1"],
    ):
        with pytest.raises(SystemExit) as stop:
            cli_main(argv)
        assert stop.value.code == 2 and "finite number of seconds" in capsys.readouterr().err, argv
    client = TriageClient(settings)
    with pytest.raises(ValueError, match="NaN"):
        client.wait(["X-1"], timeout_s=float("nan"))
    sent = client.submit("charged twice", id="X-1")
    record = {"id": "X-1", "status": "ok", "label": "billing", "stream_id": sent.stream_id}

    def answer() -> None:  # a worker's writes, after the wait began blocking on the results stream
        time.sleep(0.5)
        r.set(settings.result_key_prefix + "X-1", json.dumps(record))
        r.xadd(settings.results_stream, {"id": "X-1", "label": "billing", "stream_id": sent.stream_id})

    writer = threading.Thread(target=answer)
    writer.start()
    got = client.wait([sent], timeout_s=float("inf"))  # no deadline: until it arrives
    writer.join()
    assert got["X-1"].label == "billing"


def test_wait_from_file_names_the_line_of_a_row_without_a_stream_entry_id(cli_env, tmp_path, capsys):
    """A stream_id of "abc" (or null) went to Redis as XPENDING's bound: "Redis error", exit 1, for bad input."""
    for bad in ('"abc"', "null", "17"):
        ids = tmp_path / "ids.jsonl"
        ids.write_text('{"id": "Z0", "stream_id": "1-0"}\n\n{"id": "Z1", "stream_id": ' + bad + "}\n")
        assert cli_main(["wait", "--from-file", str(ids), "--timeout-s", "0"]) == 2, bad
        err = capsys.readouterr().err
        assert "line 3: stream_id" in err and "not a stream entry id" in err and "Redis" not in err, err
