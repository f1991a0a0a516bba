"""The start-up permission probe against real Redis ACL users: every command the stream worker sends (its own
calls and its Lua scripts'), on the keys it sends them to, is asked before anything is read.

An ACL that allowed XADD and SET but not XREADGROUP, XCLAIM, EVALSHA ... passed the probe, which asked
only the settle script's writes: the worker loaded its model, then failed every read (``read_failed``, forever), or
its heartbeat (no EVALSHA: the liveness probe restarts it, again and again). Users are created on the test Redis
under unique names and deleted afterwards; they may touch only this test's keys.
"""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from tests.worker_proc import env_with, run_cli, start_worker
from worker.key_checks import refused_commands
from worker.settings import Settings
from worker.stream.connection import connect
from worker.stream.shutdown import Shutdown
from worker.stream.source import StreamSource
from worker.stream.startup import _setup

# docs/reliability.md's ACL line for the worker, on this test's keys only
WORKER_COMMANDS = (
    "+client|setname +xgroup|create +xgroup|delconsumer +xreadgroup +ping +xpending +xinfo|groups +xrange "
    "+xack +xadd +xtrim +xclaim +set +get +exists +del +type +multi +exec +evalsha +eval"
)
PASSWORD = "acl-probe-pw-7Hq"


@pytest.fixture
def acl_user(redis_url, key_prefix):
    """``make(rules, keys=None)`` -> a URL logging in as a new ACL user with the worker's commands and ``rules``
    after them (e.g. ``-xreadgroup``), on ``keys`` (default: this test's key prefix). Deleted afterwards."""
    admin = redis.Redis.from_url(redis_url)
    made: list[str] = []

    def make(rules: str = "", keys: list[str] | None = None) -> str:
        name = f"triage-test-{uuid.uuid4().hex[:12]}"
        patterns = [f"~{k}" for k in (keys or [key_prefix + "*"])]
        made.append(name)
        admin.execute_command(
            "ACL", "SETUSER", name, "on", f">{PASSWORD}", "resetchannels", *patterns, "-@all",
            *WORKER_COMMANDS.split(), *rules.split(),
        )  # fmt: skip
        parts = urlsplit(redis_url)
        return urlunsplit(parts._replace(netloc=f"{name}:{PASSWORD}@{parts.hostname}:{parts.port or 6379}"))

    yield make
    for name in made:
        admin.execute_command("ACL", "DELUSER", name)
    admin.close()


def _settings(env: dict[str, str], url: str, **overrides) -> Settings:
    return Settings(
        redis_url=url,
        input_stream=env["TRIAGE_INPUT_STREAM"],
        results_stream=env["TRIAGE_RESULTS_STREAM"],
        dead_letter_stream=env["TRIAGE_DEAD_LETTER_STREAM"],
        result_key_prefix=env["TRIAGE_RESULT_KEY_PREFIX"],
        heartbeat_key_prefix=env["TRIAGE_HEARTBEAT_KEY_PREFIX"],
        consumer="acl-probe-w1",
        **overrides,
    )


class _Log:
    """Records what start-up logs, as {"event": ..., **fields}."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def _record(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})

    debug = info = warning = error = _record


def _start_up(settings: Settings) -> tuple[str, list[dict]]:
    """The worker's Redis start-up step (``startup._setup``), as ``run`` calls it before loading the model."""
    log = _Log()
    client = connect(settings.redis_url)
    try:
        source = StreamSource(client, settings.input_stream, settings.group, settings.consumer)
        return _setup(source, settings, Shutdown(log), log, give_up_s=10), log.events
    finally:
        client.close()


IN, R, D = "tickets", "results", "dead"  # the streams, by the key prefix's suffix
HB, REC = "heartbeat:acl-probe-w1", "tickets:recovery:triage"  # the heartbeat of the consumer; the recovery point


@pytest.mark.parametrize(
    ("rule", "command", "keys"),
    [
        ("-xreadgroup", "XREADGROUP", [IN]),  # the reads (source.py, read_scripts.py)
        ("-xclaim", "XCLAIM", [IN]),  # reclaims, the re-read of its own entries, the refresh of those in hand
        ("-xpending", "XPENDING", [IN]),
        ("-xinfo|groups", "XINFO GROUPS", [IN]),
        ("-xrange", "XRANGE", [IN]),
        ("-xack", "XACK", [IN]),
        ("-xtrim", "XTRIM", [IN]),  # inside the settle script and best effort: it was never reported at all
        ("-xadd", "XADD", [R, D]),
        ("-xgroup|create", "XGROUP CREATE", [IN]),
        ("-xgroup|delconsumer", "XGROUP DELCONSUMER", [IN]),  # at exit: its name would stay in the group forever
        ("-evalsha", "EVALSHA", [IN, R, D, REC, HB]),
        ("-eval", "EVAL", [IN, HB]),  # after a restart emptied the script cache: found on the first write
        ("-type", "TYPE", [IN, R, D, HB]),
        ("-get", "GET", [REC, HB]),
        ("-set", "SET", [REC, HB]),  # the recovery point and the heartbeat (scripts), the latest results
        ("-del", "DEL", [HB]),  # the heartbeat at exit (scripts.RELEASE)
        ("-exists", "EXISTS", [IN]),
        ("-ping", "PING", []),  # redis-py's check of a connection idle 30 s: the call after it failed (a write: exit 2)
        ("-client|setname", "CLIENT SETNAME", []),  # on connecting: refused, every call of the worker fails
        ("-multi", "MULTI", []),  # where a recreated group starts: redis-py then says only "EXEC without MULTI"
        ("-exec", "EXEC", []),
    ],
)
def test_start_up_names_each_command_the_acl_refuses_before_anything_is_read(
    acl_user, triage_env, redis_url, rule, command, keys
):
    settings = _settings(triage_env, acl_user(rule))
    admin = redis.Redis.from_url(redis_url)
    admin.xadd(settings.input_stream, {"id": "T-1", "text": "charged twice"})
    outcome, events = _start_up(settings)
    assert outcome == "config", events
    (denied,) = [e for e in events if e["event"] == "permission_denied"]
    prefix = triage_env["TRIAGE_INPUT_STREAM"][: -len(IN)]
    assert denied["error"].startswith(f"{command} ") or denied["error"].startswith(f"{command}:"), denied
    assert all(prefix + k in denied["error"] for k in keys), denied
    assert "ACL" in denied["action"], denied
    assert not admin.exists(settings.results_stream), "nothing may be written"
    assert all(g["pending"] == 0 for g in admin.xinfo_groups(settings.input_stream)), "nothing may be delivered"


def test_a_key_the_acl_does_not_cover_is_named_with_each_command_sent_to_it(acl_user, triage_env):
    """The heartbeat prefix outside the user's key patterns: the heartbeat failed at every beat, silently at start
    (``consumer_name_unchecked``), and the liveness probe restarted the worker."""
    prefix = triage_env["TRIAGE_INPUT_STREAM"][: -len(IN)]
    settings = _settings(triage_env, acl_user(keys=[prefix + "tickets*", prefix + "results", prefix + "dead",
                                                     prefix + "result:*"]))  # fmt: skip
    outcome, events = _start_up(settings)
    assert outcome == "config", events
    (denied,) = [e for e in events if e["event"] == "permission_denied"]
    lines = denied["error"].split("; ")
    beat = prefix + HB
    assert {line.split(" ", 1)[0] for line in lines} == {"TYPE", "GET", "SET", "DEL", "EVALSHA", "EVAL"}, lines
    assert all(line.count(prefix) == 1 and beat in line and "keys" in line for line in lines), lines


def test_the_probe_of_a_user_with_every_command_changes_nothing(acl_user, triage_env, redis_url):
    """``check`` asks it at any time, beside live workers: no consumer, group, stream or key is created, no entry
    read, claimed or acked, and the heartbeat of a worker under the same name is left alone."""
    settings = _settings(triage_env, acl_user())
    admin = redis.Redis.from_url(redis_url)
    entry = admin.xadd(settings.input_stream, {"id": "T-1", "text": "charged twice"})
    admin.xgroup_create(settings.input_stream, settings.group, id="0")
    admin.xreadgroup(settings.group, "other-worker", {settings.input_stream: ">"}, count=1)
    beat = settings.heartbeat_key_prefix + settings.consumer
    admin.set(beat, '{"pid": 1}', ex=60)
    before = sorted(admin.scan_iter(match=triage_env["TRIAGE_INPUT_STREAM"][: -len(IN)] + "*"))
    client = connect(settings.redis_url)
    try:
        assert refused_commands(client, settings) == []
    finally:
        client.close()
    assert sorted(admin.scan_iter(match=triage_env["TRIAGE_INPUT_STREAM"][: -len(IN)] + "*")) == before
    assert [c["name"] for c in admin.xinfo_consumers(settings.input_stream, settings.group)] == [b"other-worker"]
    (pending,) = admin.xpending_range(settings.input_stream, settings.group, min="-", max="+", count=10)
    assert pending["message_id"] == entry and pending["times_delivered"] == 1
    assert admin.get(beat) == b'{"pid": 1}' and admin.ttl(beat) > 0


def test_run_and_check_refuse_a_user_without_xreadgroup_before_the_model_loads(acl_user, triage_env, redis_url):
    """The case of the report: XADD and SET allowed, the reads not. ``run`` loaded the model and logged
    ``read_failed`` forever; now it exits 2 with one ``permission_denied`` line, and ``check`` says the same."""
    env = env_with(triage_env, TRIAGE_REDIS_URL=acl_user("-xreadgroup -xclaim"), TRIAGE_CONSUMER="acl-probe-w2")
    with start_worker(env, ready=False) as w:
        first = w.wait_for(lambda e: e.get("event") in ("permission_denied", "worker_ready", "model_loaded"), 120)
        assert first["event"] == "permission_denied", w.stderr_tail()
        assert w.wait(timeout_s=60) == 2, w.stderr_tail()
    assert f"XREADGROUP {triage_env['TRIAGE_INPUT_STREAM']}:" in first["error"], first
    assert f"XCLAIM {triage_env['TRIAGE_INPUT_STREAM']}:" in first["error"], first
    assert PASSWORD not in "\n".join(w.lines)
    admin = redis.Redis.from_url(redis_url)
    assert not admin.exists(triage_env["TRIAGE_RESULTS_STREAM"]), "nothing written"
    assert admin.xpending(triage_env["TRIAGE_INPUT_STREAM"], "triage")["pending"] == 0, "nothing delivered"

    # `check` asks the same, after its own PING (preflight.redis_problem; the worker's line grants PING)
    bad, good = (
        run_cli(env_with(env, TRIAGE_REDIS_URL=acl_user(rules)), "check", timeout_s=120)
        for rules in ("-xreadgroup -xclaim", "")
    )
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode == 2 and len(errors) == 2, bad.stderr
    assert all("TRIAGE_REDIS_URL" in e and "may not run X" in e for e in errors), errors
    assert good.returncode == 0 and "its user may run every command the worker sends" in good.stdout, good.stderr
    assert PASSWORD not in bad.stdout + bad.stderr + good.stdout + good.stderr
