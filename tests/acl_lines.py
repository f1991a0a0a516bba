"""The ACL lines of the docs, as written, for a test's own keys; users made from them; the commands a client sends.

Why from the docs: a line kept in a test beside the one in the docs drifts from it; here the documented line is
the one tested. Users get unique names and are deleted afterwards (the shared Redis has other tests' users).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.connection

REPO = Path(__file__).resolve().parents[1]
PRODUCER_DOC = REPO / "docs" / "producer.md"
RELIABILITY_DOC = REPO / "docs" / "reliability.md"
PASSWORD = "acl-lines-pw-4Tz"
# what redis-py sends on connecting, before any call: AUTH and HELLO need no grant, and the refusal of the others is
# ignored by redis-py (connection.on_connect): they are in no line
HANDSHAKE = {"AUTH", "HELLO", "CLIENT SETINFO", "CLIENT MAINT_NOTIFICATIONS", "SELECT"}
_SUBCOMMANDS = {"XINFO", "XGROUP", "CLIENT", "CONFIG", "ACL"}


def documented_rules(doc: Path, user: str) -> list[str]:
    """The rules of the ``ACL SETUSER <user>`` line of ``doc``, after the user name (``triage:`` keys as written)."""
    lines = [line.strip() for line in doc.read_text(encoding="utf-8").splitlines()]
    (line,) = [line for line in lines if line.startswith(f"ACL SETUSER {user} ")]
    return line.split()[3:]


def commands_of(rules: list[str]) -> set[str]:
    """The commands a line grants, as ``XINFO GROUPS`` (``+xinfo|groups``)."""
    return {r[1:].upper().replace("|", " ") for r in rules if r.startswith("+")}


def on_keys(rules: list[str], key_prefix: str) -> list[str]:
    """``rules`` for a test's keys: ``~triage:tickets`` -> ``~<key_prefix>tickets``, the password the test's."""
    out = []
    for rule in rules:
        if rule.startswith(">"):
            rule = ">" + PASSWORD
        elif "~" in rule:
            head, _, pattern = rule.partition("~")
            assert pattern.startswith("triage:"), rule
            rule = f"{head}~{key_prefix}{pattern[len('triage:') :]}"
        out.append(rule)
    return out


@contextmanager
def acl_user(redis_url: str, rules: list[str]) -> Iterator[tuple[str, str]]:
    """(name, URL) of a new user with ``rules`` (``on`` and the password among them); deleted afterwards."""
    admin = redis.Redis.from_url(redis_url)
    name = f"triage-test-{uuid.uuid4().hex[:12]}"
    admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
    parts = urlsplit(redis_url)
    url = urlunsplit(parts._replace(netloc=f"{name}:{PASSWORD}@{parts.hostname}:{parts.port or 6379}"))
    try:
        yield name, url
    finally:
        admin.execute_command("ACL", "DELUSER", name)
        admin.close()


class Sent:
    """Commands sent on this process's connections of one user (``XINFO GROUPS``, ``XADD``), the handshake aside:
    read from what redis-py packs, single calls and pipelines alike."""

    def __init__(self, monkeypatch, username: str):
        self.commands: set[str] = set()
        send, pack = redis.connection.AbstractConnection.send_command, redis.connection.AbstractConnection.pack_commands
        sent = self

        def send_command(conn, *args, **kwargs):
            if conn.username == username:
                sent._add(args)
            return send(conn, *args, **kwargs)

        def pack_commands(conn, commands):
            if conn.username == username:
                for args in commands:
                    sent._add(args)
            return pack(conn, commands)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_command", send_command)
        monkeypatch.setattr(redis.connection.AbstractConnection, "pack_commands", pack_commands)

    def _add(self, args) -> None:
        words = [(a.decode() if isinstance(a, bytes) else str(a)).upper() for a in args[:2]]
        name = " ".join(words) if words[0] in _SUBCOMMANDS else words[0]
        if name not in HANDSHAKE:
            self.commands.add(name)
