"""An operator destroys the consumer group, and maybe creates it again at ``$``, while a worker holds a classified
window (its pass held by tests.held_passes, so the window is in hand, by construction, when the group goes).

At ``$`` nothing is delivered again and the worker meets no NOGROUP: the window's entries are pending on no consumer.
The settle's ownership check skipped them as "not ours anymore" and their tickets, classified, got no record at all
(a reliability hunt: 32 of 32 in hand). Now an entry at or below the group's last delivered id, pending on no one,
still in the stream and settled by no one gets its record with nothing to acknowledge (``entries_lost_from_group``),
and the settle's trim stays below what the process holds, so the window's later passes are still there to write.
A group the worker itself recreates at its recovery point delivers the entries again: they get one record each, not
a record from the held window and another from their second delivery (a review of the fix found that one).
"""

from __future__ import annotations

import time

import redis

from tests.worker_proc import env_with, outcomes, start_worker, wait_settled


def _held_env(triage_env, window: int, pass_items: int) -> tuple[dict, str, str]:
    marked, release = triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "in-pass", triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "go"
    env = env_with(
        triage_env,
        TRIAGE_WINDOW_MAX_ITEMS=window,
        TRIAGE_PASS_MAX_ITEMS=pass_items,
        TRIAGE_WINDOW_TARGET_S=0,  # fixed windows: the first one is the whole backlog
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_TEST_PRELOAD="tests.held_passes",
        TRIAGE_TEST_PASS_MARK=marked,
        TRIAGE_TEST_PASS_HOLD_UNTIL=release,
    )
    return env, marked, release


def _wait_for(predicate, w, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline and w.returncode is None, w.stderr_tail()
        time.sleep(0.01)


def _all_acked(client, stream: str, group: str) -> bool:
    g = next((g for g in client.xinfo_groups(stream) if g["name"] == group), None)
    return g is not None and g["pending"] == 0 and g["lag"] == 0


def test_a_window_whose_group_was_created_again_at_the_end_still_gets_its_records(triage_env, redis_url):
    """240 tickets in one window, four passes: the first pass's settle used to trim the stream below the new group's
    start (two whole 100-entry nodes of the window), so the later passes found their entries gone."""
    env, marked, release = _held_env(triage_env, window=240, pass_items=60)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    stream, group = env["TRIAGE_INPUT_STREAM"], env.get("TRIAGE_GROUP", "triage")
    with client.pipeline() as pipe:
        for i in range(240):
            pipe.xadd(stream, {"id": f"h-{i}", "text": f"my parcel is late #{i}"})
        held = pipe.execute()
    with start_worker(env) as w:
        _wait_for(lambda: client.exists(marked), w)  # the window's first pass is held: classified, not yet written
        with client.pipeline() as pipe:  # the operator's reset: one MULTI, as an admin script would
            pipe.xgroup_destroy(stream, group)
            pipe.xgroup_create(stream, group, id="$")
            pipe.execute()
        client.xdel(stream, held[-1])  # deleted meanwhile: no record for it
        client.set(release, 1, ex=60)
        got = wait_settled(client, env, held[:-1], timeout_s=120)  # fails on a second record of any of them
        assert all(kind == "result" for kind, _ in got.values())
        after = [client.xadd(stream, {"id": f"a-{i}", "text": "refund please"}) for i in range(3)]
        wait_settled(client, env, after, timeout_s=60)  # the recreated group is read as usual
        assert sum(e["count"] for e in w.events("entries_lost_from_group")) == len(held) - 1, w.stderr_tail()
        assert w.stop() == 0, w.stderr_tail()
    assert held[-1] not in outcomes(client, env)
    assert client.xpending(stream, group)["pending"] == 0


def test_a_group_the_worker_recreates_under_a_held_window_gives_one_record_per_entry(triage_env, redis_url):
    """Only DESTROY, while one window is in its (held) pass and the next waits read for a slot: the worker recreates
    the group at its recovery point, below both, whose entries are then delivered again. The held window's settle
    must leave them to that delivery: it wrote them as lost, and the delivery wrote each a second time."""
    env, marked, release = _held_env(triage_env, window=8, pass_items=8)
    env["TRIAGE_CLAIM_IDLE_MS"] = "3000"  # the keeper's refresh, which meets the NOGROUP, every second
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    stream, group = env["TRIAGE_INPUT_STREAM"], env.get("TRIAGE_GROUP", "triage")
    client.set(release, 1, ex=600)
    with start_worker(env) as w:
        first = [client.xadd(stream, {"id": f"f-{i}", "text": f"refund #{i}"}) for i in range(8)]
        wait_settled(client, env, first, timeout_s=60)  # a recovery point, and the window size measured
        client.delete(release, marked)
        with client.pipeline() as pipe:  # one MULTI: the windows are read whole (8 each), not as the sends come
            for i in range(24):
                pipe.xadd(stream, {"id": f"h-{i}", "text": f"my parcel is late #{i}"})
            held = pipe.execute()
        _wait_for(lambda: client.exists(marked), w)
        _wait_for(lambda: client.xpending(stream, group)["pending"] == 16, w)  # held + the next window, read
        client.xgroup_destroy(stream, group)
        _wait_for(lambda: w.events("group_recreated"), w)  # the keeper's refresh or the reader met NOGROUP
        client.set(release, 1, ex=60)
        wait_settled(client, env, held, timeout_s=60)
        _wait_for(lambda: _all_acked(client, stream, group), w)  # every delivery of them settled: a second shows
        got = outcomes(client, env)
        assert {i: len(got[i]) for i in held} == {i: 1 for i in held}, got
        assert not w.events("entries_lost_from_group")
        assert w.stop() == 0, w.stderr_tail()
