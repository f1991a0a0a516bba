"""A deployment of three ACL users with docs/reliability.md's and docs/producer.md's lines, as written, on this
test's keys: a real worker as the worker's user, the producer CLI as the producer's, and ``triage-worker status``
(``--watch`` too) and ``healthcheck`` as the ops user. The ops line was "healthcheck additionally needs +get +scan"
(nothing said what ``status`` needs, nothing tested it); now each command passes under it, and the ops user's
connections send exactly the commands it grants. ``check`` runs as the worker's user, under its line.
"""

from __future__ import annotations

import json

from producer.cli import main as producer_main
from tests.acl_lines import PRODUCER_DOC, RELIABILITY_DOC, Sent, acl_user, commands_of, documented_rules, on_keys
from tests.worker_proc import env_with, start_worker
from worker.cli import main as worker_main


def _env(monkeypatch, env: dict[str, str], url: str) -> None:
    """This process's TRIAGE_ environment: the test's keys and model, logged in as ``url``'s user."""
    for k, v in {**env, "TRIAGE_REDIS_URL": url}.items():
        if k.startswith("TRIAGE_"):
            monkeypatch.setenv(k, v)


def test_worker_producer_and_ops_users_each_with_their_documented_line(
    triage_env, redis_url, key_prefix, tmp_path, monkeypatch, capsys
):
    lines = {
        user: on_keys(documented_rules(doc, user), key_prefix)
        for doc, user in (
            (RELIABILITY_DOC, "triage-worker"),
            (RELIABILITY_DOC, "triage-ops"),
            (PRODUCER_DOC, "triage-producer"),
        )
    }
    tickets = tmp_path / "t.jsonl"
    tickets.write_text(
        "".join(json.dumps(t) + "\n" for t in ({"id": "D-1", "text": "charged twice"}, {"id": "D-2", "text": " "}))
    )
    with (
        acl_user(redis_url, lines["triage-worker"]) as (_, worker_url),
        acl_user(redis_url, lines["triage-producer"]) as (_, producer_url),
        acl_user(redis_url, lines["triage-ops"]) as (ops, ops_url),
    ):
        worker_env = env_with(triage_env, TRIAGE_REDIS_URL=worker_url, TRIAGE_CONSUMER="acl-lines-w1")
        _env(monkeypatch, worker_env, worker_url)
        assert worker_main(["check"]) == 0  # the worker's user may run every command the worker sends
        assert "its user may run every command the worker sends" in capsys.readouterr().out
        with start_worker(worker_env) as w:
            _env(monkeypatch, triage_env, producer_url)
            assert producer_main(["send", str(tickets), "--wait-s", "60"]) == 0
            assert "2/2 results: " in capsys.readouterr().out  # one classified, one dead-lettered (blank text)

            sent = Sent(monkeypatch, ops)
            _env(monkeypatch, triage_env, ops_url)
            assert worker_main(["status", "--json"]) == 0, capsys.readouterr().err
            snap = json.loads(capsys.readouterr().out)
            assert snap["queue"]["exists"] and snap["queue"]["pending"] == 0 and snap["queue"]["backlog"] == 0
            assert [(x["consumer"], x["alive"], x["pending"]) for x in snap["workers"]] == [("acl-lines-w1", True, 0)]
            assert snap["results"]["count"] == 1 and snap["dead_letters"]["length"] == 1
            # (not --ready: the heartbeat says "starting" until the keeper's next beat, a third of the TTL after start)
            assert worker_main(["healthcheck"]) == 0
            assert json.loads(capsys.readouterr().out)["consumer"] == "acl-lines-w1"
            assert worker_main(["healthcheck", "--consumer", "acl-lines-w1"]) == 0
            capsys.readouterr()
            # a URL asking for health checks: the watch's connection, idle between refreshes, is PINGed first
            _env(monkeypatch, triage_env, ops_url + "?health_check_interval=1")
            assert worker_main(["status", "--watch", "--count", "2", "--interval-s", "1.2", "--json"]) == 0
            refreshes = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert len(refreshes) == 2 and all(x["queue"]["exists"] for x in refreshes)
            assert sent.commands == commands_of(lines["triage-ops"])
            assert w.stop() == 0, w.stderr_tail()


def test_status_under_a_user_refused_xinfo_groups_says_so_instead_of_showing_no_queue(
    triage_env, redis_url, key_prefix, monkeypatch, capsys
):
    """XINFO GROUPS refused (NOPERM) was read as "no such stream": ``status`` showed no queue, length 0, exit 0.
    Then it said "cannot read Redis" with exit 1, the code for Redis unreachable; an ACL too narrow is configuration:
    exit 2, naming the command and the ACL line, as the producer does. ``healthcheck`` refused its SCAN says so."""
    import redis

    redis.Redis.from_url(redis_url).xadd(triage_env["TRIAGE_INPUT_STREAM"], {"id": "S-1", "text": "hello"})
    ops = on_keys(documented_rules(RELIABILITY_DOC, "triage-ops"), key_prefix)
    with acl_user(redis_url, [r for r in ops if r != "+xinfo|groups"]) as (_, url):
        _env(monkeypatch, triage_env, url)
        assert worker_main(["status", "--json"]) == 2
        err = capsys.readouterr().err
        assert "xinfo|groups" in err and "grant the ops ACL line" in err and "cannot read Redis" not in err, err
    with acl_user(redis_url, [r for r in ops if r != "+scan"]) as (_, url):
        _env(monkeypatch, triage_env, url)
        assert worker_main(["healthcheck"]) == 1
        err = capsys.readouterr().err
        assert "may not read the heartbeats" in err and "cannot reach Redis" not in err, err
