"""A drain window far larger than a pass (TRIAGE_WINDOW_MAX_ITEMS vs TRIAGE_PASS_MAX_ITEMS), results
written after each pass: while the window's later passes run, its earlier passes' results are already
in Redis (and acked), and each pass's write is still results + acks in one atomic step.

Before: one setting capped both the drain and the pass, and a window's results were written only
after its last pass, so no result of a window was visible while more than two windows' worth of
entries were pending.
"""

from __future__ import annotations

import threading

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import push, record, synth_tickets, tally, wait_until

WINDOW, PASS = 256, 32


def test_results_are_written_after_each_pass_of_a_large_window(launch, chaos_redis, tiny_model_dir, tmp_path):
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=WINDOW,
        TRIAGE_PASS_MAX_ITEMS=PASS,
        TRIAGE_PASS_MAX_TOKENS=10**6,
        TRIAGE_MAX_INPUT_TOKENS=256,
        TRIAGE_MAX_WAIT_MS=200,
        TRIAGE_CONSUMER="passes-a",
        TRIAGE_WINDOW_TARGET_S=0,  # fixed windows: one window of WINDOW tickets, whatever the measured rate
    )
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    client = chaos_redis.client()
    samples: list[tuple[int, int]] = []  # (results written, entries pending)
    done = threading.Event()

    def sample() -> None:
        probe = chaos_redis.client()
        while not done.wait(0.01):
            pipe = probe.pipeline(transaction=True)  # one consistent snapshot
            pipe.xlen(results)
            pipe.xpending(stream, "triage")
            n, pend = pipe.execute()
            samples.append((n, int(pend["pending"])))

    with launch(env) as w:
        tickets = [{"id": t["id"], "text": t["text"] * 4} for t in synth_tickets(WINDOW, seed=41, prefix="wp")]
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        push(client, stream, tickets)  # all at once: one window
        wait_until(
            lambda: tally(client, results, dead, [t["id"] for t in tickets]).lost == [],
            timeout_s=300,
            interval_s=0.2,
            what="every ticket classified",
        )
        done.set()
        sampler.join(5)
        assert w.stop() == 0, w.stderr_tail()

    windows, passes = w.events("window"), w.events("pass")
    assert windows[0]["items"] == WINDOW and windows[0]["passes"] >= WINDOW // PASS, windows[0]
    assert all(p["items"] <= PASS for p in passes)
    # results of the window were in Redis while more than two passes' worth of it was still pending
    partial = [(n, pend) for n, pend in samples if n > 0 and pend > 2 * PASS]
    assert partial, f"never saw results before the window's last pass: {sorted(set(samples))[:20]}"
    # once the window is read, every result written is an entry acked, and every entry acked a result written
    assert all(n + pend == WINDOW for n, pend in samples if n > 0), sorted(set(samples))[:20]
    t = tally(client, results, dead, [x["id"] for x in tickets])
    assert t.duplicates == 0 and not t.dead
    record(
        "window_passes",
        window=WINDOW,
        pass_cap=PASS,
        passes=len(passes),
        samples=len(samples),
        partial_samples=len(partial),
    )
