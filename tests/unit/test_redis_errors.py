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
