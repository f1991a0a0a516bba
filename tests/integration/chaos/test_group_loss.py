"""The consumer group disappears while a window is in flight: Redis restarts without its data
(no AOF, no RDB: `kill -9` + restart = an empty server), or somebody runs `XGROUP DESTROY`.

The worker must notice it wherever Redis says NOGROUP (a read, the write of the window in
hand, the refresh of its in-flight entries), recreate the group from the recovery point, drop
the windows it read from the lost group, classify the tickets sent afterwards, and stop on the
first SIGTERM. Before the fix the write's ownership check got NOGROUP forever while the reader,
the only part that recreated the group, waited for the loop: no ticket was classified again.
"""

from __future__ import annotations

import time

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import (
    count_done,
    push,
    read_stream,
    record,
    sized,
    synth_tickets,
    tally,
    wait_until,
)
from worker.logs import event_ms

GROUP = "triage"


def test_redis_restart_without_data_recovers_and_classifies_new_tickets(
    launch, redis_server_factory, tiny_model_dir, tmp_path
):
    server = redis_server_factory(appendonly=False)  # save "" too: a restart comes back empty
    env = worker_env(
        tiny_model_dir,
        server.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=32,
        TRIAGE_PASS_MAX_ITEMS=32,
        TRIAGE_RECONNECT_MAX_S=1,
        TRIAGE_MAX_INPUT_TOKENS=96,
        TRIAGE_CONSUMER="lossy-a",
    )
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    before = synth_tickets(sized(1500, 3000), seed=21, prefix="pre")
    push(server.client(), stream, before)
    with launch(env) as w:
        wait_until(
            lambda: count_done(server.client(), results, dead) >= 96,
            timeout_s=120,
            interval_s=0.05,
            what="a few windows written before the crash",
        )
        server.crash()
        time.sleep(2.0)  # down longer than a window: the write of the window in hand fails and is retried
        server.start()  # empty: the stream, the group, results, everything is gone
        back_ms = time.time() * 1000
        after = synth_tickets(sized(200, 1000), seed=22, prefix="post")
        push(server.client(), stream, after)
        wait_until(
            lambda: tally(server.client(), results, dead, [t["id"] for t in after]).lost == [],
            timeout_s=sized(180, 600),
            interval_s=0.5,
            what="every ticket sent after the restart classified",
        )
        assert w.stop(timeout_s=60) == 0, w.stderr_tail()
    t = tally(server.client(), results, dead, [t["id"] for t in after])
    assert t.duplicates == 0 and not t.dead
    assert w.events("group_recreated"), w.stderr_tail()
    assert server.client().xpending(stream, GROUP)["pending"] == 0
    record(
        "group_loss_restart",
        tickets_before=len(before),
        tickets_after=len(after),
        lost_after=len(t.lost),
        duplicates_after=t.duplicates,
        recreated=len(w.events("group_recreated")),
        windows_dropped=len(w.events("window_dropped")),
        group_recreated_after_s=_event_s(w, "group_recreated", back_ms),
        first_result_after_restart_s=round((t.first_ms - back_ms) / 1000, 2),
    )


def test_group_destroyed_mid_run_recovers(launch, chaos_redis, tiny_model_dir, tmp_path):
    """`XGROUP DESTROY` with a short claim idle (the write of every window checks ownership)."""
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=32,
        TRIAGE_PASS_MAX_ITEMS=32,
        TRIAGE_CLAIM_IDLE_MS=200,
        TRIAGE_MAX_INPUT_TOKENS=96,
        TRIAGE_CONSUMER="destroyed-a",
        TRIAGE_MAX_DELIVERIES=1000,
    )
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    client = chaos_redis.client()
    before = synth_tickets(sized(1500, 3000), seed=23, prefix="pre")
    push(client, stream, before)
    with launch(env) as w:
        wait_until(
            lambda: count_done(client, results, dead) >= 96,
            timeout_s=120,
            interval_s=0.05,
            what="a few windows written before the destroy",
        )
        client.xgroup_destroy(stream, GROUP)
        destroyed_ms = time.time() * 1000
        after = synth_tickets(sized(200, 1000), seed=24, prefix="post")
        push(client, stream, after)
        everyone = [t["id"] for t in before + after]
        wait_until(
            lambda: tally(client, results, dead, everyone).lost == [],
            timeout_s=sized(240, 900),
            interval_s=0.5,
            what="every ticket classified after the destroy",
        )
        assert w.stop(timeout_s=60) == 0, w.stderr_tail()
    t = tally(client, results, dead, everyone)
    assert not t.dead
    assert w.events("group_recreated"), w.stderr_tail()
    # the group comes back at the recovery point, not at 0: only what was in flight can be classified twice
    # (before: the whole stream was replayed, 896 duplicates in the run)
    assert t.duplicates <= 2 * 32, t.duplicates
    assert client.xlen(stream) <= 200 + 2 * 32, "settled entries are trimmed from the input stream"
    post_ids = {x["id"] for x in after}
    first_post_ms = min(int(f["classified_at_ms"]) for _, f in read_stream(client, results) if f["id"] in post_ids)
    record(
        "group_loss_destroy",
        tickets=len(everyone),
        lost=len(t.lost),
        duplicates=t.duplicates,
        recreated=len(w.events("group_recreated")),
        windows_dropped=len(w.events("window_dropped")),
        group_recreated_after_s=_event_s(w, "group_recreated", destroyed_ms),
        first_result_after_destroy_s=round((first_post_ms - destroyed_ms) / 1000, 2),
        input_xlen_after=client.xlen(stream),
    )


def _event_s(w, event: str, since_ms: float) -> float:
    """Seconds from ``since_ms`` (Unix ms) to the worker's first ``event`` log line."""
    return round((event_ms(w.events(event)[0]) - since_ms) / 1000, 2)
