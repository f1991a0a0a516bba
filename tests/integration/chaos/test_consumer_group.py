"""Several workers in one consumer group, no faults: the work is shared, no ticket is
classified twice, nothing is lost; throughput per worker count is published.

TRIAGE_CLAIM_IDLE_MS stays long (60 s): with no faults nothing may be reclaimed, so any
duplicate here would be a real bug (two workers reading the same entry).
"""

from __future__ import annotations

import time

import pytest

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import count_done, push, record, sized, synth_tickets, tally, wait_until


@pytest.mark.parametrize("workers", sized([2, 3], [1, 2, 3]))
def test_workers_share_the_group_without_duplicates(launch, workers, chaos_redis, tiny_model_dir, tmp_path):
    n = sized(400, 3000)
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=16,
        TRIAGE_PASS_MAX_ITEMS=16,
        TRIAGE_CLAIM_IDLE_MS=60_000,
        TRIAGE_MAX_INPUT_TOKENS=96,
    )
    client = chaos_redis.client()
    results, dead = env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    tickets = synth_tickets(n, seed=21, prefix="cg")
    procs = [launch({**env, "TRIAGE_CONSUMER": f"cg-{i}"}, ready=False) for i in range(workers)]
    try:
        for p in procs:
            p.wait_ready()
        t0 = time.monotonic()
        push(client, env["TRIAGE_INPUT_STREAM"], tickets)
        wait_until(
            lambda: count_done(client, results, dead) >= n,
            timeout_s=sized(300, 1200),
            interval_s=0.2,
            what="every ticket done",
        )
        wall_s = time.monotonic() - t0
        codes = [p.stop() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * workers, [p.stderr_tail() for p in procs]
    t = tally(client, results, dead, [tk["id"] for tk in tickets])
    assert t.lost == [] and not t.dead
    assert t.duplicates == 0, f"{t.duplicated_ids} tickets classified more than once without any fault"
    assert sorted(t.workers) == [f"cg-{i}" for i in range(workers)], f"not every worker got work: {dict(t.workers)}"
    assert not any(p.events("entries_claimed") for p in procs)
    record(
        "consumer_group",
        workers=workers,
        tickets=n,
        per_worker=dict(sorted(t.workers.items())),
        duplicates=t.duplicates,
        lost=len(t.lost),
        tickets_per_s=round(n / wall_s, 1),
        wall_s=round(wall_s, 1),
    )
