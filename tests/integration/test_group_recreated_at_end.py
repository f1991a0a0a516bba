"""An operator destroys the consumer group and creates it again at ``$`` while a worker holds a classified window.

Nothing is delivered again (``$``: new entries only) and the worker meets no NOGROUP, so no recovery starts; the
window's entries are pending on no consumer. The settle's ownership check skipped them as "not ours anymore"
(acked by an earlier try, or reclaimed): their tickets, classified, got no record at all (found by a reliability
hunt: 32 of 32 in hand lost). Now an entry pending on no one, still in the stream and settled by no one gets its
record, with nothing to acknowledge (``entries_lost_from_group``). One deleted meanwhile gets none: a deleted
entry is its claimer's (an orphan dead letter), never two records. The pass is held (tests.held_passes) so the
window is in hand, by construction, when the group goes.
"""

from __future__ import annotations

import time

import redis

from tests.worker_proc import env_with, outcomes, start_worker, wait_settled

WINDOW = 8


def test_a_group_recreated_at_the_end_under_a_held_window_still_gets_its_records(triage_env, redis_url):
    marked, release = triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "in-pass", triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "go"
    env = env_with(
        triage_env,
        TRIAGE_WINDOW_MAX_ITEMS=WINDOW,
        TRIAGE_PASS_MAX_ITEMS=WINDOW,
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_TEST_PRELOAD="tests.held_passes",
        TRIAGE_TEST_PASS_MARK=marked,
        TRIAGE_TEST_PASS_HOLD_UNTIL=release,
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    stream, group = env["TRIAGE_INPUT_STREAM"], env.get("TRIAGE_GROUP", "triage")
    held = [client.xadd(stream, {"id": f"h-{i}", "text": f"my parcel is late #{i}"}) for i in range(WINDOW)]
    with start_worker(env) as w:
        deadline = time.monotonic() + 120
        while not client.exists(marked):  # the window is in the (held) pass: classified, not yet written
            assert time.monotonic() < deadline and w.returncode is None, w.stderr_tail()
            time.sleep(0.01)
        with client.pipeline() as pipe:  # the operator's reset: one MULTI, as an admin script would
            pipe.xgroup_destroy(stream, group)
            pipe.xgroup_create(stream, group, id="$")
            pipe.execute()
        client.xdel(stream, held[-1])  # deleted meanwhile: no record for it
        client.set(release, 1, ex=60)
        got = wait_settled(client, env, held[:-1], timeout_s=60)  # fails on a second record of any of them
        assert all(kind == "result" for kind, _ in got.values()), got
        after = [client.xadd(stream, {"id": f"a-{i}", "text": "refund please"}) for i in range(3)]
        wait_settled(client, env, after, timeout_s=60)  # the recreated group is read as usual
        lost = w.events("entries_lost_from_group")
        assert sum(e["count"] for e in lost) == WINDOW - 1, w.stderr_tail()
        assert w.stop() == 0, w.stderr_tail()
    assert held[-1] not in outcomes(client, env)
    assert client.xpending(stream, group)["pending"] == 0
