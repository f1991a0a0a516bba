"""kill -9 of the worker at random points, again and again, then a final drain:
every ticket has a result, nothing is lost, nothing is written twice.

Why nothing can be lost: a window's results and its XACK go to Redis in ONE
settle script (atomic, as a MULTI/EXEC), so an entry is never acked without its result. A kill before EXEC
leaves the window's entries pending: they are classified again, by the restarted
consumer re-reading its own pending list (same name) or by another consumer via
XAUTOCLAIM once idle for TRIAGE_CLAIM_IDLE_MS (new name). A kill after EXEC loses
nothing either. So with one worker alive at a time there are no duplicates at all: asserted
(the issue's bound, "at most the in-flight windows per kill", one in hand + one prefetched, is
recorded beside it; a settle that wrote results without their acks would stay inside it).
"""

from __future__ import annotations

import random
import time

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import (
    count_done,
    pending_of,
    push,
    record,
    sized,
    synth_tickets,
    tally,
    wait_until,
)


def test_kill9_at_random_points_loses_nothing(launch, chaos_redis, tiny_model_dir, tmp_path):
    n = sized(600, 5000)
    kills = sized(5, 20)
    batch = 32
    rng = random.Random(1234)
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=batch,
        TRIAGE_PASS_MAX_ITEMS=batch,
        TRIAGE_CLAIM_IDLE_MS=1500,
        TRIAGE_MAX_DELIVERIES=1000,  # isolate loss from poison detection: a kill counts as a delivery
        TRIAGE_HEARTBEAT_TTL_S=3,
        TRIAGE_MAX_INPUT_TOKENS=sized(96, 512),
    )
    client = chaos_redis.client()
    tickets = synth_tickets(n, seed=11, prefix="k9")
    push(client, env["TRIAGE_INPUT_STREAM"], tickets)
    results, dead = env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]

    kill_log = []
    consumer = "k9-a"
    t_start = time.monotonic()
    for k in range(kills):
        # alternate: restart under the same name (re-reads its own pending) or a new one (XAUTOCLAIM)
        consumer = "k9-a" if k % 2 == 0 else f"k9-new-{k}"
        w = launch({**env, "TRIAGE_CONSUMER": consumer})
        try:
            before = count_done(client, results, dead)
            # a random point: after 0-2 windows of work, sometimes right after start-up
            target = before + rng.choice([0, 1, batch // 2, batch, 2 * batch, 3 * batch])
            wait_until(
                lambda target=target, w=w: (
                    count_done(client, results, dead) >= min(target, n) or w.returncode is not None
                ),
                timeout_s=120,
                interval_s=0.02,
                what="progress before the kill",
            )
            time.sleep(rng.random() * 0.3)
            pending = sum(pending_of(client, env["TRIAGE_INPUT_STREAM"], "triage").values())
        finally:
            w.kill()
        assert w.returncode == -9, w.stderr_tail()
        kill_log.append(
            {"consumer": consumer, "done_before": count_done(client, results, dead), "pending_at_kill": pending}
        )
        if count_done(client, results, dead) >= n:
            break

    # a new consumer drains what is left, reclaiming the dead consumers' pending entries
    final = launch({**env, "TRIAGE_CONSUMER": "k9-final"}, "run", "--drain")
    assert final.wait(timeout_s=sized(300, 1200)) == 0, final.stderr_tail()
    elapsed = time.monotonic() - t_start

    t = tally(client, results, dead, [tk["id"] for tk in tickets])
    assert t.lost == [], f"{len(t.lost)} tickets lost, e.g. {t.lost[:5]}"
    assert not t.dead, f"unexpected dead letters: {list(t.dead)[:5]}"
    assert set(t.results) == {tk["id"] for tk in tickets}
    bound = len(kill_log) * 2 * batch  # one window in hand + one prefetched, per kill
    assert t.duplicates == 0, (t.duplicates, bound)
    assert client.xpending(env["TRIAGE_INPUT_STREAM"], "triage")["pending"] == 0
    record(
        "kill9",
        tickets=n,
        kills=len(kill_log),
        pending_at_kills=sum(k["pending_at_kill"] for k in kill_log),
        results=sum(t.results.values()),
        duplicates=t.duplicates,
        duplicated_ids=t.duplicated_ids,
        lost=len(t.lost),
        duplicate_bound=bound,
        wall_s=round(elapsed, 1),
    )
