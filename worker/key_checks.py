"""Checks of the Redis keys a worker uses: their names (the streams and key prefixes must not be one another)
and, against a live Redis, their types and who holds a consumer name. Part of ``preflight``; imports no torch.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from worker.problem import Problem

STREAM_VARS = ("TRIAGE_INPUT_STREAM", "TRIAGE_RESULTS_STREAM", "TRIAGE_DEAD_LETTER_STREAM")
_SAME_STREAM_WHY = {
    ("TRIAGE_INPUT_STREAM", "TRIAGE_RESULTS_STREAM"): "every result would be read back as a ticket",
    ("TRIAGE_INPUT_STREAM", "TRIAGE_DEAD_LETTER_STREAM"): "every dead letter would be read back as a ticket and "
    "dead-lettered again, forever",
    ("TRIAGE_RESULTS_STREAM", "TRIAGE_DEAD_LETTER_STREAM"): "results and dead letters would mix in one stream",
}


def key_name_problems(settings) -> list[Problem]:
    """The keys the worker writes must not be one another: three different streams, none of them the input's
    recovery-point key (``<input>:recovery:<group>``) nor under a key prefix (a ticket id or a consumer name would
    complete it: SET replaces a stream), and neither key prefix inside the other (a ticket id could overwrite a
    heartbeat; ``status`` would scan every result key)."""
    from worker.stream.source import recovery_key

    streams = stream_keys(settings)
    out = []
    for (a, b), why in _SAME_STREAM_WHY.items():
        if streams[a] == streams[b]:
            out.append(Problem(f"{a} / {b}", f"both are {streams[a]!r}: {why}; give the three streams different keys"))
    recovery = recovery_key(settings.input_stream, settings.group)
    prefixes = {
        "TRIAGE_RESULT_KEY_PREFIX": (settings.result_key_prefix, "the latest-result key of a ticket with id"),
        "TRIAGE_HEARTBEAT_KEY_PREFIX": (settings.heartbeat_key_prefix, "the heartbeat of a worker named"),
    }
    for var in STREAM_VARS[1:]:
        if streams[var] == recovery:
            out.append(
                Problem(
                    f"{var} / TRIAGE_INPUT_STREAM",
                    f"{recovery!r} is the input stream's recovery-point key (TRIAGE_INPUT_STREAM + ':recovery:' + "
                    "TRIAGE_GROUP), a string the worker writes; choose another key",
                )
            )
    recovery_var = "TRIAGE_INPUT_STREAM + ':recovery:' + TRIAGE_GROUP (the recovery-point key)"
    for var, key in {**streams, recovery_var: recovery}.items():
        for prefix_var, (prefix, whose) in prefixes.items():
            if var == recovery_var and settings.input_stream.startswith(prefix):
                continue  # the input stream's own problem says it: its recovery key moves with it
            if key.startswith(prefix):
                out.append(
                    Problem(
                        f"{var} / {prefix_var}",
                        f"{key!r} starts with {prefix_var} {prefix!r}: {whose} {key[len(prefix) :]!r} would "
                        + (
                            "overwrite it; choose a prefix that does not cover it"
                            if var == recovery_var
                            else "overwrite the stream; choose a key outside the prefix"
                        ),
                    )
                )
    result_prefix, heartbeat_prefix = settings.result_key_prefix, settings.heartbeat_key_prefix
    if result_prefix.startswith(heartbeat_prefix) or heartbeat_prefix.startswith(result_prefix):
        out.append(
            Problem(
                "TRIAGE_RESULT_KEY_PREFIX / TRIAGE_HEARTBEAT_KEY_PREFIX",
                f"{result_prefix!r} and {heartbeat_prefix!r}: one starts with the other, so a ticket id could name a "
                "worker's heartbeat key (and status would read every result key as a heartbeat); use two prefixes "
                "neither of which starts with the other",
            )
        )
    return out


def stream_key_problems(url: str, settings) -> list[Problem]:
    """The three stream keys must be streams (or absent): the worker refuses other types at start."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        return stream_type_problems(client, stream_keys(settings))
    except redis.RedisError as e:
        return [Problem("TRIAGE_REDIS_URL", f"cannot read key types: {e}")]
    finally:
        client.close()


def stream_keys(settings) -> dict[str, str]:
    """TRIAGE_*_STREAM -> its key."""
    return {
        "TRIAGE_INPUT_STREAM": settings.input_stream,
        "TRIAGE_RESULTS_STREAM": settings.results_stream,
        "TRIAGE_DEAD_LETTER_STREAM": settings.dead_letter_stream,
    }


def stream_type_problems(client, keys: Mapping[str, str]) -> list[Problem]:
    """One problem per key (``var -> key``) that holds another Redis type than a stream (absent is fine); one
    round trip. Raises what the client raises when Redis cannot be read."""
    pipe = client.pipeline(transaction=False)
    for key in keys.values():
        pipe.type(key)
    out = []
    for (var, key), kind in zip(keys.items(), pipe.execute()):
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind not in ("none", "stream"):
            out.append(
                Problem(var, f"the key {key!r} holds a Redis {kind}, not a stream; rename it or point {var} elsewhere")
            )
    return out


def consumer_holder(url: str, settings) -> dict | str | None:
    """The heartbeat of the worker that holds ``settings.consumer`` (None: nobody; a str: why it was not read)."""
    import redis

    from worker.stream.health import fresh_heartbeats

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        beats = fresh_heartbeats(client, settings.heartbeat_key_prefix, settings.consumer)
        return next((beat for _, beat in beats), None)
    except redis.RedisError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        client.close()


# ----------------------------------------------------------------- permissions (ACL)
PROBE_SHA = "0" * 40  # no script hashes to this: EVALSHA answers NOSCRIPT once its ACL check has passed
NOT_AN_ID = "not-an-id"  # refused by the command itself, after the ACL check: nothing read, claimed or created


def worker_probes(settings) -> list[tuple[str, str | None, tuple]]:
    """(command, key, call) for every command the stream worker sends, on every key it sends it to: its own calls
    (``worker/stream/``: connection, source, health) and those of its Lua scripts, which Redis checks against the
    same ACL (``tests/unit/test_acl_probe_table.py`` fails when ``worker/stream/`` sends one this table lacks). Each
    call passes the real command's ACL check on the real key (or, for DEL, on a key beside it) and then does nothing:
    an argument the command refuses, a range that is empty, an expiry of 0, an id of 0-0. So ``check`` may run it any
    time, and a worker before it reads. PING too: redis-py sends it on a connection idle for 30 s
    (``health_check_interval``), and a refused one fails the call after it (a write: exit 2, hours into a run)."""
    from worker.stream.source import recovery_key

    s = settings
    stream, group, me = s.input_stream, s.group, s.consumer
    rec = recovery_key(stream, group)
    result = s.result_key_prefix + "permission-probe"
    beat = s.heartbeat_key_prefix + s.consumer
    nobody = f"permission-probe-{uuid.uuid4().hex}"  # a consumer and a heartbeat key that exist nowhere
    probes: list[tuple[str, str | None, tuple]] = [
        ("CLIENT SETNAME", None, ("CLIENT", "SETNAME", "triage-worker")),  # on connecting (stream.connection)
        ("PING", None, ("PING",)),  # redis-py's health check of an idle connection (stream.connection)
        ("XGROUP CREATE", stream, ("XGROUP", "CREATE", stream, group, NOT_AN_ID)),
        ("XGROUP DELCONSUMER", stream, ("XGROUP", "DELCONSUMER", stream, group, nobody)),
        ("XREADGROUP", stream, ("XREADGROUP", "GROUP", group, me, "COUNT", 1, "STREAMS", stream, NOT_AN_ID)),
        ("XCLAIM", stream, ("XCLAIM", stream, group, me, NOT_AN_ID, "0-0", "JUSTID")),
        ("XPENDING", stream, ("XPENDING", stream, group, "-", "+", 1, me)),
        ("XINFO GROUPS", stream, ("XINFO", "GROUPS", stream)),
        ("XRANGE", stream, ("XRANGE", stream, "0-0", "0-0")),
        ("XACK", stream, ("XACK", stream, group, "0-0")),
    ]
    if s.input_trim:  # the settle script trims only then, and silently (best effort) where the ACL refuses it
        probes.append(("XTRIM", stream, ("XTRIM", stream, "MINID", "0")))
    for key in (s.results_stream, s.dead_letter_stream):
        probes.append(("XADD", key, ("XADD", key, "NOMKSTREAM", "0-0", "probe", "1")))
    for key in (stream, s.results_stream, s.dead_letter_stream, beat):
        probes.append(("TYPE", key, ("TYPE", key)))
    for key in (rec, result, beat):  # the recovery point, the latest results, the heartbeat
        probes += [("GET", key, ("GET", key)), ("SET", key, ("SET", key, "1", "EX", 0))]
    probes.append(("DEL", beat, ("DEL", s.heartbeat_key_prefix + nobody)))
    for key in (stream, s.results_stream, s.dead_letter_stream, rec, result, beat):  # the scripts' KEYS
        probes += [
            ("EVALSHA", key, ("EVALSHA", PROBE_SHA, 1, key)),
            ("EVAL", key, ("EVAL", "return 0", 1, key)),  # after a restart EVALSHA answers NOSCRIPT: EVAL follows
        ]
    # last, its one transaction (where a recreated group starts): it only reads, and MULTI refused shows only here
    # (redis-py's transaction then fails with "EXEC without MULTI"); EXEC refused discards it (EXECABORT)
    return probes + [
        ("MULTI", None, ("MULTI",)),
        ("EXISTS", stream, ("EXISTS", stream)),
        ("GET", rec, ("GET", rec)),
        ("EXEC", None, ("EXEC",)),
    ]


def refused_commands(client, settings) -> list[str]:
    """What Redis refuses the worker (ACL): one ``COMMAND key, key: Redis's words`` per command and refusal (the
    command itself, or the keys), found without writing, reading or claiming anything (``worker_probes``).

    Asked at start-up, before the worker reads: a refusal met later (the first read, a reclaim, the heartbeat, a
    write) comes after entries were delivered or the name was taken, and a worker that stops or is restarted on it
    counts one more delivery each time (dead letters after TRIAGE_MAX_DELIVERIES), or beats no more and is
    restarted by its liveness probe, forever. Runs on a connection of its own (``client``'s settings). Raises what
    the client raises when Redis cannot be reached."""
    import redis

    from worker.stream.sink import is_permission_error

    pool = client.connection_pool
    probe_pool = redis.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
    probe = redis.Redis(connection_pool=probe_pool)
    probe.response_callbacks.clear()  # raw replies: redis-py's parsers expect the shapes of other calls
    probes = worker_probes(settings)
    try:
        pipe = probe.pipeline(transaction=False)
        for _, _, call in probes:
            pipe.execute_command(*call)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.exceptions.NoPermissionError as e:  # raised on connecting: its CLIENT SETNAME (client_name)
            return [f"CLIENT SETNAME: {e}"]
    finally:
        probe_pool.disconnect()
    refused: dict[tuple[str, str], list[str]] = {}  # (command, Redis's words) -> the keys it was refused on
    for (command, key, _), reply in zip(probes, replies):
        if isinstance(reply, redis.RedisError) and is_permission_error(str(reply)):
            keys = refused.setdefault((command, str(reply)), [])
            if key and key not in keys:  # GET <recovery point> is asked twice
                keys.append(key)
    return [f"{cmd} {', '.join(keys)}: {why}" if keys else f"{cmd}: {why}" for (cmd, why), keys in refused.items()]


def permission_problems(url: str, settings) -> list[Problem]:
    """``refused_commands`` as problems of TRIAGE_REDIS_URL's user, for ``triage-worker check``."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3, client_name="triage-worker")
    try:
        refused = refused_commands(client, settings)
    except redis.RedisError as e:
        return [Problem("TRIAGE_REDIS_URL", f"cannot check the ACL user's permissions: {e}")]
    finally:
        client.close()
    return [
        Problem("TRIAGE_REDIS_URL", f"its user may not run {line} (docs/reliability.md, the ACL line)")
        for line in refused
    ]
