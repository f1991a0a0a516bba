"""The start-up permission probe (``key_checks.worker_probes``) asks exactly the commands the stream worker sends.

Read from the source of ``worker/stream/``: the commands its Lua scripts call, and its redis-py calls. A command
added to a script or a read without a row in the probe would pass start-up and fail later (a read failing forever,
a heartbeat the liveness probe restarts on); a row for a command nothing sends any more would refuse a user who
needs no such grant. Pure: no Redis.
"""

from __future__ import annotations

import re
from pathlib import Path

from worker.key_checks import worker_probes
from worker.settings import Settings

STREAM = Path(__file__).resolve().parents[2] / "worker" / "stream"
# redis.call('XGROUP', 'DELCONSUMER', ...), redis.pcall('GET', ...), the settle script's try('XADD', ...)
_LUA_CALL = re.compile(r"(?:redis\.p?call|\btry)\(\s*'([A-Z]+)'(?:\s*,\s*'([A-Z]+)')?")
_SUBCOMMANDS = ("XGROUP", "XINFO", "CLIENT")
# redis-py calls of the worker's own code, and the command each sends (a coarse read: Event.set() reads as SET too)
PY_CALLS = {
    ".xreadgroup(": ["XREADGROUP"],
    ".xautoclaim(": ["XAUTOCLAIM"],
    ".xclaim(": ["XCLAIM"],
    ".xgroup_create(": ["XGROUP CREATE"],
    ".xpending_range(": ["XPENDING"],
    ".xpending(": ["XPENDING"],
    ".xinfo_groups(": ["XINFO GROUPS"],
    ".xrange(": ["XRANGE"],
    ".xack(": ["XACK"],
    ".xadd(": ["XADD"],
    ".xtrim(": ["XTRIM"],
    ".type(": ["TYPE"],
    ".exists(": ["EXISTS"],
    ".set(": ["SET"],
    ".delete(": ["DEL"],
    ".evalsha(": ["EVALSHA"],
    ".eval(": ["EVAL"],
    "pipeline(transaction=True)": ["MULTI", "EXEC"],
    "client_name=": ["CLIENT SETNAME"],
    "health_check_interval=": ["PING"],  # redis-py PINGs a connection idle that long before using it
}
# sent by redis-py calls this table does not need to tell apart from others (dict.get is everywhere)
ALSO_SENT = {"GET"}


def sent_commands() -> set[str]:
    text = "\n".join(path.read_text(encoding="utf-8") for path in sorted(STREAM.glob("*.py")))
    out = {f"{a} {b}" if a in _SUBCOMMANDS and b else a for a, b in _LUA_CALL.findall(text)}
    for call, commands in PY_CALLS.items():
        if call in text:
            out.update(commands)
    return out


def probed_commands(**overrides) -> set[str]:
    return {command for command, _, _ in worker_probes(Settings(consumer="w1", **overrides))}


def test_every_command_the_worker_sends_is_probed_at_start_up():
    missing = sent_commands() - probed_commands(input_trim=True)
    assert not missing, f"add a row for each to key_checks.worker_probes: {sorted(missing)}"


def test_the_probe_asks_for_no_command_the_worker_does_not_send():
    extra = probed_commands(input_trim=True) - sent_commands() - ALSO_SENT
    assert not extra, f"nothing in worker/stream sends these any more: drop their rows {sorted(extra)}"


def test_xtrim_is_asked_only_of_a_worker_that_trims():
    assert "XTRIM" in probed_commands(input_trim=True) and "XTRIM" not in probed_commands(input_trim=False)


def test_every_probe_names_a_key_of_the_worker_or_none():
    s = Settings(consumer="w1")
    ours = (s.input_stream, s.results_stream, s.dead_letter_stream, s.result_key_prefix, s.heartbeat_key_prefix)
    for command, key, call in worker_probes(s):
        assert key is None or key.startswith(ours), (command, key)
        assert command.split()[0] == call[0], (command, call)
