"""Checks of the Redis keys a worker uses: their names (the streams and key prefixes must not be one another)
and, against a live Redis, their types and who holds a consumer name. Part of ``preflight``; imports no torch.
"""

from __future__ import annotations

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
    for var, key in streams.items():
        for prefix_var, (prefix, whose) in prefixes.items():
            if key.startswith(prefix):
                out.append(
                    Problem(
                        f"{var} / {prefix_var}",
                        f"{key!r} starts with {prefix_var} {prefix!r}: {whose} {key[len(prefix) :]!r} would "
                        "overwrite the stream; choose a key outside the prefix",
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
