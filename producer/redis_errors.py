"""Redis errors the producer tells in one line: a command its ACL user may not run, and what a stopped send had sent.

Why: for a key outside the user's patterns Redis says only "no permissions to access one of the keys used as
arguments", naming neither the command nor the key, and a refused ``XINFO GROUPS`` is a ``ResponseError`` like "no
such key": the backlog read as 0 (backpressure off) and ``wait`` never looked for an expired result. So every call of
the client goes through ``asking`` (a pipeline through ``execute``), and a refusal is an ``AclRefused`` naming both;
the CLI prints it in one line and exits 2. The least-privilege line: docs/producer.md, "Redis ACL".

A key of another type where a stream belongs (``SET triage:tickets x``) is likewise a ``ResponseError`` ("WRONGTYPE")
that ``XINFO GROUPS`` would read as "no such key" (a backlog of 0): it comes out as a ``WrongType`` naming the command
and the key, which the CLI tells as the setting to fix (exit 2).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis

DOCS = 'docs/producer.md, "Redis ACL"'


class AclRefused(redis.exceptions.NoPermissionError):
    """The Redis user's ACL refused ``command`` on ``keys`` (``why``: Redis's words). Still a ``NoPermissionError``
    (a ``ResponseError``) for callers that catch those, never read as "no such key"."""

    def __init__(self, command: str, keys: str, why: str, *, before: str = ""):
        self.command, self.keys, self.why = command, keys, why
        where = f"(sent on connecting, before {before} on {keys})" if before else f"on {keys}"
        super().__init__(f"the Redis user may not run {command} {where} ({why})")


class WrongType(redis.exceptions.ResponseError):
    """``command`` met a key of ``keys`` that holds another Redis type than the command works on (a string where a
    stream belongs): Redis's WRONGTYPE, naming the command and the key(s). Still a ``ResponseError``."""

    def __init__(self, command: str, keys: str, why: str):
        self.command, self.keys, self.why = command, keys, why
        super().__init__(f"{command} {keys}: {why}")


def is_wrong_type(reply: object) -> bool:
    """Redis's WRONGTYPE error reply (``Operation against a key holding the wrong kind of value``)."""
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith("WRONGTYPE")


def refusal(reply: Exception, command: str, keys: str) -> Exception:
    """``reply`` (an error reply or exception) as an ``AclRefused`` when it is a refusal of the ACL, as a ``WrongType``
    when a key holds another type; else as it is.

    When Redis names another command than the call's, that one was refused: redis-py's ``SELECT`` of a URL's
    database (``/1``) on connecting, sent before the call and refused with the call's name on it."""
    if isinstance(reply, redis.exceptions.NoPermissionError) and not isinstance(reply, AclRefused):
        named = _NAMED.search(str(reply))
        refused = named[1].replace("|", " ").upper() if named else command.upper()
        if refused != command.upper():
            return AclRefused(refused, keys, str(reply), before=command)
        return AclRefused(command, keys, str(reply))
    if is_wrong_type(reply) and not isinstance(reply, WrongType):
        return WrongType(command, keys, str(reply))
    return reply


_NAMED = re.compile(r"run the '([^']+)' command")


@contextmanager
def asking(command: str, keys: str) -> Iterator[None]:
    """Run one call of ``command`` on ``keys``: a refusal of the ACL comes out as an ``AclRefused`` naming them, a key
    of another type as a ``WrongType``."""
    try:
        yield
    except redis.exceptions.ResponseError as e:
        raised = refusal(e, command, keys)
        if raised is e:
            raise
        raise raised from None


def execute(pipe, command: str, keys: Sequence[str]) -> list:
    """The replies of a pipeline of ``command`` calls, one per key of ``keys``; the first error reply raised, a
    refusal of the ACL as an ``AclRefused`` naming its key (redis-py's own message gives the command and all its
    arguments instead: a whole ticket, for an XADD), a key of another type as a ``WrongType``."""
    replies = pipe.execute(raise_on_error=False)
    for key, reply in zip(keys, replies):
        if isinstance(reply, Exception):
            raised = refusal(reply, command, key)
            if raised is reply:
                reply.args = (f"{command} {key}: {reply.args[0] if reply.args else reply}", *reply.args[1:])
            raise raised
    return replies


def refused_line(e: redis.exceptions.NoPermissionError) -> str:
    """One line for the CLI: what was refused and where the line to grant is."""
    what = str(e) if isinstance(e, AclRefused) else f"the Redis user may not run a command ({e})"
    return f"{what}; grant the producer's ACL line ({DOCS})"


def partial(e: BaseException) -> str:
    """What a send that Redis interrupted had sent (``TriageClient.submit_many``), if it was one."""
    if not hasattr(e, "submitted"):
        return ""
    unsure, refused = len(getattr(e, "unconfirmed", [])), getattr(e, "refused", [])
    if refused:  # Redis answered every ticket of the chunk: those it refused were not added
        shown = ", ".join(refused[:5]) + (" ..." if len(refused) > 5 else "")
        return f" ({len(e.submitted)} tickets sent; {len(refused)} refused, not sent: {shown}; none after that chunk)"
    if not unsure:
        return f" ({len(e.submitted)} tickets sent before that)"
    return f" ({len(e.submitted)} tickets sent before that; {unsure} more may have been: their reply was lost)"


def wrong_type_lines(settings, e: WrongType) -> list[str]:
    """The settings (TRIAGE_*_STREAM) whose key ``e`` met, one line each, as ``triage-worker status``
    says them: with the key's type where TYPE may be asked (it is not in the producer's ACL line: "another type"
    then). Empty when the key is no stream setting's."""
    from worker.key_checks import stream_keys, stream_type_problems

    named = set(e.keys.split(", "))  # XREAD names both streams it reads
    keys = {var: key for var, key in stream_keys(settings).items() if key in named}
    if not keys:
        return []
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        problems = stream_type_problems(client, keys)
    except redis.RedisError:  # TYPE refused (the ACL), or Redis gone meanwhile: said without the type
        problems = []
    finally:
        client.close()
    if problems:
        return [str(p) for p in problems]
    if len(keys) == 1:
        [(var, key)] = keys.items()
        return [f"{var}: the key {key!r} holds another Redis type than a stream; rename it or point {var} elsewhere"]
    return [
        f"{' / '.join(keys)}: one of the keys {', '.join(map(repr, keys.values()))} holds another Redis type than a "
        f"stream ({e.command}: {e.why}); rename it or point its setting elsewhere"
    ]
