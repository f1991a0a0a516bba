"""Load and limits: a big backlog drains with flat memory (the worker holds at most one window
in hand + one prefetched), backlog and lag are visible in the batch log lines, the results
and dead-letter streams are trimmed at their approximate MAXLEN (never below it), and the
producer refuses or blocks when the input backlog reaches its limit.
"""

from __future__ import annotations

import statistics
import threading

import pytest

from producer.client import BacklogFull, TriageClient
from producer.settings import ProducerSettings
from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import RssSampler, push, record, sized, synth_tickets, wait_until

NODE_SLACK = 200  # approximate trimming removes whole radix-tree nodes (stream-node-max-entries = 100)


def _group(client, stream: str) -> tuple[int, int]:
    """(lag, pending) of the "triage" group."""
    for g in client.xinfo_groups(stream):
        if g["name"] in (b"triage", "triage"):
            return int(g.get("lag") or 0), int(g.get("pending") or 0)
    return -1, -1


def test_backlog_drains_with_flat_memory_and_trimmed_streams(launch, redis_server_factory, tiny_model_dir, tmp_path):
    n = sized(3000, 100_000)
    bad = sized(100, 1000)  # invalid UTF-8 entries: dead letters, to exercise the dead-letter MAXLEN
    batch = 64
    results_maxlen, dead_maxlen = n // 4, bad // 3
    server = redis_server_factory(appendonly=False)  # a memory test: skip fsync so the backlog loads fast
    env = worker_env(
        tiny_model_dir,
        server.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=batch,
        TRIAGE_PASS_MAX_ITEMS=batch,
        TRIAGE_MAX_INPUT_TOKENS=32,
        TRIAGE_RESULTS_MAXLEN=results_maxlen,
        TRIAGE_DEAD_LETTER_MAXLEN=dead_maxlen,
        TRIAGE_CONSUMER="backlog-a",
        TRIAGE_LOG_SUMMARY_S=5,
    )
    client = server.client()
    stream = env["TRIAGE_INPUT_STREAM"]
    tickets = synth_tickets(n, seed=9, prefix="bl")
    entries = [dict(t) for t in tickets]
    for i in range(bad):  # spread through the backlog
        entries.insert((i * 97) % len(entries), {"id": f"bl-bad-{i}", "text": b"\xff\xfe not utf-8"})
    push(client, stream, entries, chunk=2000)
    total = len(entries)

    pending_seen: list[int] = []

    def progress() -> int:
        lag, pending = _group(client, stream)
        pending_seen.append(pending)
        return total - lag - pending if lag >= 0 else 0

    with launch(env) as w:
        sampler = RssSampler(w.pid, interval_s=sized(0.05, 0.5), progress=progress)
        sampler.start()
        wait_until(
            lambda: _group(client, stream) == (0, 0),
            timeout_s=sized(300, 1800),
            interval_s=1.0,
            what="the backlog to drain",
        )
        # the group says drained once the last window is acked; its "window" line is logged just after, and read
        # by a thread of this process after that: counted before it, the windows missed the last one
        wait_until(
            lambda: sum(b["items"] + b["dead_lettered"] for b in w.events("window")) >= total,
            timeout_s=60,
            interval_s=0.05,
            what="every window's log line",
        )
        samples = sampler.stop()
        batches_phase1 = len(w.events("window"))

        # producer-side protection, against a live worker: 'block' keeps the backlog under the limit
        limit = 200
        extra = sized(600, 5000)
        producer = TriageClient(
            ProducerSettings(
                redis_url=server.url,
                input_stream=stream,
                group="triage",
                input_max_backlog=limit,
                backpressure="block",
                backpressure_timeout_s=120,
                submit_chunk_size=50,
            )
        )
        seen_backlog: list[int] = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen_backlog.append(producer.backlog())
                stop.wait(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        submitted = producer.submit_many(
            [{"id": f"bp-{i}", "text": f"my order {i} never arrived"} for i in range(extra)]
        )
        stop.set()
        watcher.join(5)
        assert len(submitted) == extra
        wait_until(lambda: _group(client, stream) == (0, 0), timeout_s=300, what="the producer's tickets to drain")
        assert w.stop() == 0, w.stderr_tail()

    # figures first (published even when an assertion below fails), then the checks
    ids = [e["id"] for e in entries] + [s.ticket_id for s in submitted]
    keys = [env["TRIAGE_RESULT_KEY_PREFIX"] + i for i in ids]
    missing = [
        i
        for k0 in range(0, len(keys), 5000)
        for i, v in zip(ids[k0 : k0 + 5000], client.mget(keys[k0 : k0 + 5000]))
        if v is None
    ]
    # RSS swings by the size of one forward pass's temporaries; "flat" = the typical level does not climb
    rss = [(kb, done / total) for _t, kb, done in samples if done >= 0]
    kbs = [kb for kb, _f in rss] or [0]
    early = [kb for kb, f in rss if 0.1 <= f < 0.5] or [kb for kb, _f in rss[: max(1, len(rss) // 2)]] or [0]
    late = [kb for kb, f in rss if f >= 0.75] or [kb for kb, _f in rss[-max(1, len(rss) // 4) :]] or [0]
    growth_mb = (statistics.median(late) - statistics.median(early)) / 1024
    lags = [b["backlog"] for b in w.events("window")[:batches_phase1] if b.get("backlog") is not None] or [-1]
    results_xlen, dead_xlen = client.xlen(env["TRIAGE_RESULTS_STREAM"]), client.xlen(env["TRIAGE_DEAD_LETTER_STREAM"])
    record(
        "backlog",
        backlog=total,
        batch_items=batch,
        lost=len(missing),
        max_pending=max(pending_seen),
        backlog_logged_first=lags[0],
        backlog_logged_last=lags[-1],
        rss_min_mb=round(min(kbs) / 1024, 1),
        rss_median_early_mb=round(statistics.median(early) / 1024, 1),
        rss_median_late_mb=round(statistics.median(late) / 1024, 1),
        rss_max_mb=round(max(kbs) / 1024, 1),
        rss_median_growth_mb=round(growth_mb, 1),
        rss_samples=len(rss),
        drain_s=round(samples[-1][0], 1) if samples else None,
        results_xlen=results_xlen,
        results_maxlen=results_maxlen,
        dead_xlen=dead_xlen,
        dead_maxlen=dead_maxlen,
        producer_limit=limit,
        producer_max_backlog_seen=max(seen_backlog),
        producer_submitted=extra,
    )

    # nothing lost: every ticket's latest-result key exists (the results stream itself is trimmed)
    assert missing == [], f"{len(missing)} tickets have no result, e.g. {missing[:5]}"
    # memory: the worker reads at most one window in hand + one prefetched, and its RSS level stays put
    assert max(pending_seen) <= 2 * batch, max(pending_seen)
    assert len(rss) >= 8, "too few RSS samples"
    assert growth_mb < 64, (
        f"median RSS grew {growth_mb:.0f} MB while draining "
        f"({statistics.median(early)} -> {statistics.median(late)} kB)"
    )
    # backlog and lag are in the logs, and fall as the worker drains
    assert lags[0] >= total - 3 * batch and lags[-1] == 0, (lags[:3], lags[-3:])
    assert all(a >= b for a, b in zip(lags, lags[1:])), "backlog went up while nothing was pushed"
    assert w.events("summary"), "no periodic summary line"
    # trimming: approximately MAXLEN, never below it
    assert results_maxlen <= results_xlen <= results_maxlen + NODE_SLACK
    assert dead_maxlen <= dead_xlen <= dead_maxlen + NODE_SLACK
    # producer 'block' kept the backlog under its limit
    assert max(seen_backlog) <= limit, max(seen_backlog)


def test_producer_refuses_beyond_the_backlog_limit(chaos_redis, tmp_path):
    """No worker running: 'refuse' raises at once, 'block' raises after its timeout.

    Nothing beyond the limit is written.
    """
    url, stream = chaos_redis.url, "chaos:bp:tickets"
    refuse = TriageClient(
        ProducerSettings(
            redis_url=url, input_stream=stream, input_max_backlog=100, backpressure="refuse", submit_chunk_size=40
        )
    )
    assert len(refuse.submit_many([f"ticket {i}" for i in range(100)])) == 100
    with pytest.raises(BacklogFull) as e:
        refuse.submit_many([f"more {i}" for i in range(30)])
    assert e.value.backlog == 100 and e.value.submitted == []
    block = TriageClient(
        ProducerSettings(
            redis_url=url, input_stream=stream, input_max_backlog=100, backpressure="block", backpressure_timeout_s=0.5
        )
    )
    with pytest.raises(BacklogFull):
        block.submit("one too many")
    assert chaos_redis.client().xlen(stream) == 100
