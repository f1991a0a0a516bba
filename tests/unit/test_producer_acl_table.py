"""docs/producer.md's ACL line grants exactly the commands ``producer/`` sends (PING aside), read from the source.

A call added to the client without its grant passes every test run as the default user and fails an integrator's
deployment (a NOPERM one day, on one path); a grant for a command nothing sends any more is privilege nobody needs.
The integration test (tests/integration/test_producer_acl.py) records what the operations send; this one also
sees the paths those operations do not take. Pure: no Redis.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.acl_lines import PRODUCER_DOC, commands_of, documented_rules

PRODUCER = Path(__file__).resolve().parents[2] / "producer"
# not the integrator's producer (docs/producer.md, "Redis ACL"): the demo's own namespace, RQ's commands, a server
NOT_COVERED = {"demo.py", "rq_client.py", "local_redis.py"}
# redis-py calls on the client (``self.redis.``, ``client.redis.``) or a pipeline of it (``pipe.``), and their commands
PY_CALLS = {
    "xadd": "XADD",
    "xinfo_groups": "XINFO GROUPS",
    "xlen": "XLEN",
    "xrange": "XRANGE",
    "xrevrange": "XREVRANGE",
    "xread": "XREAD",
    "xpending_range": "XPENDING",
    "mget": "MGET",
}
NOT_COMMANDS = {"pipeline", "execute"}
_CALL = re.compile(r"\b(?:redis|pipe)\.([a-z_]+)\(")
# not sent by the client the producer builds (no health_check_interval); by one passed in, or a URL asking for it
ONLY_WITH_HEALTH_CHECKS = {"PING"}


def called() -> dict[str, set[str]]:
    """redis-py method -> the files that call it."""
    out: dict[str, set[str]] = {}
    for path in sorted(PRODUCER.glob("*.py")):
        if path.name not in NOT_COVERED:
            for method in _CALL.findall(path.read_text(encoding="utf-8")):
                out.setdefault(method, set()).add(path.name)
    return out


def test_every_redis_call_of_the_producer_is_in_the_table():
    unknown = {m: files for m, files in called().items() if m not in PY_CALLS and m not in NOT_COMMANDS}
    assert not unknown, f"add each to PY_CALLS and its command to docs/producer.md's ACL line: {unknown}"


def test_the_documented_line_grants_what_the_producer_sends_and_nothing_else():
    sent = {PY_CALLS[m] for m in called() if m in PY_CALLS}
    granted = commands_of(documented_rules(PRODUCER_DOC, "triage-producer"))
    assert sent - granted == set(), "the line lacks these"
    assert granted - sent == ONLY_WITH_HEALTH_CHECKS, "nothing in producer/ sends these"


def test_the_line_lets_the_producer_write_the_input_stream_only():
    rules = documented_rules(PRODUCER_DOC, "triage-producer")
    keys = [r for r in rules if "~" in r]
    assert "resetkeys" in rules and "-@all" in rules and "resetchannels" in rules
    assert [k for k in keys if not k.startswith("%R~")] == ["~triage:tickets"], keys
