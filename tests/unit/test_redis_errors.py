"""Error codes of Redis replies, scripts' included, as each server version words them (captured from the servers)."""

import pytest
import redis

from worker.stream.group import is_nogroup
from worker.stream.scripts import error_code

REDIS_62 = (
    "Error running script (call to f_b5b28305184197ccbb2e74bd3d5cbfbf76c89be0): @user_script:13: "
    "NOGROUP No such key 'tst:ng' or consumer group 'g'"
)  # Redis 6.2.14 wraps a command's error inside a script
REDIS_7 = (
    "NOGROUP No such key 'tst:ng' or consumer group 'g' script: b5b28305184197ccbb2e74bd3d5cbfbf76c89be0, "
    "on @user_script:13."
)  # Redis 7.0 and Valkey 8.1 pass the code on first


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (REDIS_62, "NOGROUP"),
        (REDIS_7, "NOGROUP"),
        ("NOGROUP No such key 's' or consumer group 'g' in XREADGROUP with GROUP option", "NOGROUP"),
        ("WRONGTYPE t:results holds a hash, not a stream", "WRONGTYPE"),
        (REDIS_62.replace("NOGROUP No such key", "WRONGTYPE Operation against"), "WRONGTYPE"),
        ("unknown command 'XAUTOCLAIM'", "unknown"),
        ("Error running script (call to f_0): @user_script:3: user_script:3: Script attempted to access", "Error"),
    ],
)
def test_error_code_on_every_server_version(message, code):
    assert error_code(redis.ResponseError(message)) == code


def test_a_lost_group_is_recognised_from_a_script_on_redis_62_too():
    """Matching only 7.0's wording, a lost group met on 6.2 by the own-pending re-read (a script) looked like any read
    error, and the group was never recreated (test_group_loss.py on a 6.2.14 server timed out)."""
    assert is_nogroup(redis.ResponseError(REDIS_62))
    assert is_nogroup(redis.ResponseError(REDIS_7))
    assert not is_nogroup(redis.ResponseError("ERR no such key"))
    assert not is_nogroup(RuntimeError("NOGROUP"))  # only Redis replies


def test_a_replica_or_failover_reply_is_transient_whatever_class_redis_py_gives_it():
    """redis-py 5+ turns READONLY / MASTERDOWN / TRYAGAIN into classes and drops the code from the message."""
    from worker.stream.connection import is_passing, is_transient

    for e in (
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.exceptions.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
        redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.ResponseError("LOADING Redis is loading the dataset in memory"),
    ):
        assert is_transient(e) and is_passing(e), e
    for e in (
        redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."),
        redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's unable to persist to disk."),
    ):
        assert is_passing(e) and not is_transient(e), e
    for e in (
        redis.exceptions.NoPermissionError("this user has no permissions to run the 'xgroup|create' command"),
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    ):
        assert not is_passing(e), e


@pytest.mark.parametrize(
    "error, state, words",
    [
        (redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), "unreachable", "URL"),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "replica", "primary"),
        (redis.ResponseError("READONLY You can't write against a read only replica."), "replica", "primary"),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), "loading", "loading"),
        (redis.ResponseError("BUSY Redis is busy running a script."), "busy", "SCRIPT KILL"),
        (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots"), "misconf", "stop-writes-on-bgsave"),
        (
            redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
            "out_of_memory",
            "maxmemory",
        ),
        (redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'."), "out_of_memory", "maxmemory"),
    ],
)
def test_each_passing_state_says_what_ends_it(error, state, words):
    """--drain's give-up line said "check TRIAGE_REDIS_URL and that Redis is running" for a Redis out of memory."""
    from worker.stream.connection import is_passing, passing_state

    assert is_passing(error)
    got, fix = passing_state(error)
    assert got == state and words in fix, (got, fix)


@pytest.mark.parametrize(
    "message",
    [
        "ERR The user executing the script can't run this command or subcommand",  # in a script, Redis 6.2 and 7.0
        "ERR The user executing the script can't access at least one of the keys mentioned in the command",
        "ERR ACL failure in script: User triage-worker has no permissions to run the 'xack' command",  # 7.2, Valkey
        "NOPERM this user has no permissions to run the 'set' command or its subcommand",  # a direct command
    ],
)
def test_a_refused_permission_is_told_apart_from_a_passing_refusal(message):
    from worker.stream.sink import is_permission_error

    assert is_permission_error(message)
    assert not is_permission_error("OOM command not allowed when used memory > 'maxmemory'.")


# captured from a read script (READ_NEW) on a Redis 6.2.14 replica: a refused call is wrapped twice, no class of its own
REDIS_62_READONLY = (
    "Error running script (call to f_afdfa9778652a67688ac995b66d01511ebbb95f8): @user_script:43: @user_script: 43: "
    "-READONLY You can't write against a read only replica."
)


def test_a_read_script_refused_by_a_redis_62_replica_is_the_replica_state_as_on_7():
    """Every read became a script (worker/stream/read_scripts.py). On 7.0 and Valkey a replica's refusal inside one
    still comes as redis-py's ReadOnlyError; 6.2 wraps it in a plain ResponseError, which read as a failed read
    ("read_failed", no reconnect) where the XREADGROUP it replaced read as Redis unavailable (a failover)."""
    from worker.stream.connection import is_passing, is_transient, passing_state

    e = redis.ResponseError(REDIS_62_READONLY)
    assert error_code(e) == "READONLY" and is_transient(e) and is_passing(e)
    assert passing_state(e)[0] == "replica"
    assert error_code(redis.ResponseError(REDIS_62)) == "NOGROUP"  # a command's own error: wrapped once, as before
