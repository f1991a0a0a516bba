"""Windows that take longer than the heartbeat TTL and the claim idle time, with two workers.

* The heartbeat is refreshed from its own thread: a working worker never looks dead, and the
  heartbeat says what it is doing (phase, since when, when the current pass started).
* The owner keeps its in-flight entries fresh (XCLAIM ... JUSTID on its own entries, atomically
  with an ownership check), so the window it prefetched, waiting for the long pass before it,
  is not reclaimed by the other worker.

Before: the loop beat between windows only, so the key expired during every long window
(`healthcheck` said unhealthy); the prefetched window sat idle for a whole pass and the second
worker reclaimed it (compute thrown away, delivery counts rising towards the poison limit).
"""

from __future__ import annotations

import json
import threading

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import count_done, push, record, tally, wait_until

WINDOW = 128
CLAIM_IDLE_MS = 600
HEARTBEAT_TTL_S = 1
TEXT = "my parcel is late and the invoice is wrong, please help me with the refund of the order"
HOLD_S = 1.5  # each pass held that long (tests.held_passes): longer than the TTL and the claim idle time on any CPU


def test_long_passes_keep_heartbeat_and_ownership(launch, redis_server_factory, tiny_model_dir, tmp_path):
    # No AOF: with `appendfsync always` a busy disk (another test writing a model, pip) held every write of the
    # keepers for up to 1.3 s here, past this test's 1 s TTL. Durability is not what this test is about.
    server = redis_server_factory(appendonly=False)
    env = worker_env(
        tiny_model_dir,
        server.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=WINDOW,
        TRIAGE_PASS_MAX_ITEMS=WINDOW,
        TRIAGE_PASS_MAX_TOKENS=10**6,
        TRIAGE_MAX_INPUT_TOKENS=512,
        TRIAGE_HEARTBEAT_TTL_S=HEARTBEAT_TTL_S,
        TRIAGE_CLAIM_IDLE_MS=CLAIM_IDLE_MS,
        TRIAGE_MAX_WAIT_MS=0,
        TRIAGE_TEST_PRELOAD="tests.held_passes",
        TRIAGE_TEST_PASS_HOLD_S=HOLD_S,
    )
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    client = server.client()
    tickets = [{"id": f"long-{i}", "text": f"{TEXT} #{i}"} for i in range(6 * WINDOW)]  # six windows, each held
    push(client, stream, tickets)
    key = env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + "long-a"
    samples: list[dict | None] = []
    done = threading.Event()

    def sample() -> None:
        probe = server.client()
        while not done.wait(0.02):
            raw = probe.get(key)
            samples.append(None if raw is None else json.loads(raw))

    with launch({**env, "TRIAGE_CONSUMER": "long-a"}) as a:
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with launch({**env, "TRIAGE_CONSUMER": "long-b"}) as b:
            wait_until(
                lambda: count_done(client, results, dead) >= len(tickets),
                timeout_s=600,
                interval_s=0.5,
                what="every long ticket classified",
            )
            done.set()
            sampler.join(5)
            assert b.stop() == 0, b.stderr_tail()
        assert a.stop() == 0, a.stderr_tail()

    missing = sum(s is None for s in samples)
    assert samples and missing == 0, f"heartbeat missing in {missing} of {len(samples)} samples while working"
    phases = {s.get("phase") for s in samples}
    assert "inferring" in phases, phases
    inferring = [s for s in samples if s.get("phase") == "inferring"]
    assert all(
        isinstance(s.get("pass_started_at_ms"), int) and s["phase_since_ms"] <= s["beat_at_ms"] for s in inferring
    )
    assert all(k in samples[-1] for k in ("windows", "items", "dead_lettered"))
    claimed = [e for w in (a, b) for e in w.events("entries_claimed")]
    assert claimed == [], f"a live worker's entries were reclaimed: {claimed}"
    assert not a.events("entries_not_ours_anymore") and not b.events("entries_not_ours_anymore")
    t = tally(client, results, dead, [x["id"] for x in tickets])
    assert t.lost == [] and t.duplicates == 0 and not t.dead
    assert t.workers["long-a"] > 0 and t.workers["long-b"] > 0
    infer_ms = [e["infer_ms"] for w in (a, b) for e in w.events("window")]
    # the test means something only if windows outlast the heartbeat TTL and the claim idle time: held to (HOLD_S)
    assert max(infer_ms) > max(CLAIM_IDLE_MS, HEARTBEAT_TTL_S * 1000), f"windows too short to test: {max(infer_ms)} ms"
    record(
        "long_pass",
        tickets=len(tickets),
        window=WINDOW,
        max_window_infer_ms=max(infer_ms),
        heartbeat_samples=len(samples),
        heartbeat_missing=missing,
        phases=sorted(p for p in phases if p),
        reclaimed_from_live_worker=len(claimed),
    )
