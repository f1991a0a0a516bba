"""A worker frozen (SIGSTOP) longer than TRIAGE_CLAIM_IDLE_MS while holding a window: another
worker reclaims its pending entries (XAUTOCLAIM) and classifies them. When the frozen one
resumes (SIGCONT) it must not lose or corrupt anything, and should not write a stale second
result for entries it no longer owns.

Defined behaviour (loop.py ``_commit``): a window older than half the claim idle time is
checked against XPENDING before writing; entries no longer pending on this consumer are
dropped from the write ("entries_not_ours_anymore"). Results and their XACK are one
MULTI/EXEC, so whoever acks an entry has written its result: a stale writer can add a
duplicate, never lose a ticket.

The freeze is placed deterministically in the worst spot: while the worker's pass over the
window it read runs (held there, tests.held_passes, until the test has frozen it: a GC pause,
swap or CPU starvation looks the same), so nothing of that window was written before.
"""

from __future__ import annotations

import signal

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import push, record, sized, synth_tickets, tally, wait_until

GROUP = "triage"


def _pending_ids(client, stream: str, consumer: str) -> set[str]:
    rows = client.xpending_range(stream, GROUP, min="-", max="+", count=10_000, consumername=consumer)
    return {r["message_id"].decode() for r in rows}


def test_frozen_worker_is_reclaimed_and_writes_nothing_stale(launch, chaos_redis, tiny_model_dir, tmp_path):
    n = sized(60, 2000)
    batch = 16
    claim_idle_ms = 2000
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=batch,
        TRIAGE_PASS_MAX_ITEMS=batch,
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_CLAIM_IDLE_MS=claim_idle_ms,
        TRIAGE_MAX_INPUT_TOKENS=64,
    )
    marked, release = env["TRIAGE_RESULT_KEY_PREFIX"] + "in-pass", env["TRIAGE_RESULT_KEY_PREFIX"] + "go"
    held = {"TRIAGE_TEST_PRELOAD": "tests.held_passes", "TRIAGE_TEST_PASS_MARK": marked}
    held["TRIAGE_TEST_PASS_HOLD_UNTIL"] = release
    client = chaos_redis.client()
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    big = synth_tickets(batch, seed=8, prefix="held")  # A's window
    tickets = synth_tickets(n, seed=3, prefix="slow")

    with (
        launch({**env, **held, "TRIAGE_CONSUMER": "slow-a"}, ready=False) as a,
        launch({**env, "TRIAGE_CONSUMER": "fast-b"}, ready=False) as b,
    ):
        a.wait_ready()
        b.wait_ready()
        b.freeze()  # B waits frozen until A holds the window (stopped before A's window is pushed)
        pipe = client.pipeline(transaction=True)  # all at once: A's next read takes the whole window
        for fields in big:
            pipe.xadd(stream, fields)
        pipe.execute()
        wait_until(lambda: client.exists(marked), timeout_s=60, interval_s=0.005, what="A in its window's pass")
        a.freeze()  # in the pass (held), before anything of the window is written
        client.set(release, 1)  # the pass runs on once A is resumed
        frozen = _pending_ids(client, stream, "slow-a")
        assert len(frozen) == batch and client.xlen(results) == 0
        push(client, stream, tickets)
        b.signal(signal.SIGCONT)
        # B classifies everything, A's frozen window included (after claim_idle_ms of idleness)
        all_ids = [t["id"] for t in big + tickets]
        wait_until(
            lambda: not tally(client, results, dead, all_ids).lost,
            timeout_s=sized(240, 900),
            interval_s=0.5,
            what="B to finish every ticket, the frozen ones included",
        )
        assert not _pending_ids(client, stream, "slow-a")
        a.signal(signal.SIGCONT)
        a.wait_for(
            lambda e: e.get("event") in ("window", "window_dropped"), timeout_s=120
        )  # A finished the window it held (written or dropped)
        assert a.stop() == 0, a.stderr_tail()
        assert b.stop() == 0, b.stderr_tail()

    t = tally(client, results, dead, all_ids)
    assert t.lost == [] and not t.dead
    writers: dict[str, list[str]] = {}
    for _sid, f in client.xrange(results, "-", "+"):
        writers.setdefault(f[b"stream_id"].decode(), []).append(f[b"worker"].decode())
    claimed = b.events("entries_claimed")
    dropped = sum(e["count"] for e in a.events("entries_not_ours_anymore"))
    stale = {sid: w for sid, w in writers.items() if sid in frozen and w != ["fast-b"]}
    record(
        "slow_consumer",
        tickets=len(all_ids),
        frozen_entries=len(frozen),
        reclaimed=sum(e["count"] for e in claimed),
        stale_writes_dropped=dropped,
        stale_results_written=sum(len(w) - 1 for w in stale.values()),
        duplicates=t.duplicates,
        lost=len(t.lost),
        results_by_worker=dict(t.workers),
    )
    assert sum(e["count"] for e in claimed) >= len(frozen)
    assert client.xpending(stream, GROUP)["pending"] == 0
    # each frozen entry was written exactly once, by the worker that reclaimed it
    assert stale == {}, (
        f"{len(stale)} of {len(frozen)} reclaimed entries got a second, stale result from the resumed worker "
        f"(e.g. {next(iter(stale.items()))}); it dropped {dropped}. See docs/reliability.md, 'Slow consumers'."
    )
    assert dropped >= len(frozen)
