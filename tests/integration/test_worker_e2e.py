"""End to end: one real worker process (tiny model) against test-owned streams; tickets
pushed with redis-py and redis-cli exactly as an external system would.

The worker is module-scoped (its start-up, mostly importing torch, is the slow part);
every test uses its own ticket ids, and the last test stops it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis

from tests.worker_proc import delete_keys, env_with, make_env, run_cli, start_worker, wait_settled

LABELS = {"billing", "technical", "account", "shipping", "other", "needs_review"}
MAX_TEXT_BYTES = 3000


@pytest.fixture(scope="module")
def stream_env(tiny_model_dir, redis_url, tmp_path_factory):
    """Like conftest's ``triage_env`` but shared by this module's tests (one worker for all)."""
    prefix = f"triage-test:{uuid.uuid4().hex[:10]}:"
    yield make_env(
        tiny_model_dir,
        redis_url,
        prefix,
        tmp_path_factory.mktemp("cache"),
        TRIAGE_CONSUMER=f"e2e-{uuid.uuid4().hex[:6]}",
        TRIAGE_WINDOW_MAX_ITEMS=16,
        TRIAGE_PASS_MAX_ITEMS=16,
        TRIAGE_MAX_WAIT_MS=30,
        TRIAGE_MAX_TEXT_BYTES=MAX_TEXT_BYTES,
        TRIAGE_MAX_INPUT_TOKENS=48,
        TRIAGE_LOG_SUMMARY_S=1,
        TRIAGE_MAX_DELIVERIES=2,
        TRIAGE_CLAIM_IDLE_MS=300,
        TRIAGE_HEARTBEAT_TTL_S=6,  # a beat every 2 s: a second process under the same name sees one soon
    )
    delete_keys(redis_url, prefix)


@pytest.fixture(scope="module")
def worker(stream_env):
    w = start_worker(stream_env)
    yield w
    w.kill()


@pytest.fixture(scope="module")
def r(redis_url):
    return redis.Redis.from_url(redis_url, decode_responses=True)


def test_tickets_get_one_result_each_with_a_label_latency_and_key(worker, stream_env, r):
    stream = stream_env["TRIAGE_INPUT_STREAM"]
    texts = [
        "I was charged twice",
        "app crashes on start " * 3,
        "password reset email never arrives",
        "where is my parcel?",
    ] * 6
    sent = {}
    for i, text in enumerate(texts):
        fields = {"id": f"ok-{i}", "text": text}
        if i % 3 == 0:
            fields["meta"] = json.dumps({"customer": i})
        if i % 4 == 0:
            fields["subject"] = "Urgent"
        sent[r.xadd(stream, fields)] = fields
    settled = wait_settled(r, stream_env, sent)
    for sid, (kind, rec) in settled.items():
        assert kind == "result", rec
        assert rec["id"] == sent[sid]["id"] and rec["label"] in LABELS
        assert float(rec["latency_ms"]) >= 0 and rec["model"] and rec["worker"] == stream_env["TRIAGE_CONSUMER"]
        assert set(json.loads(rec["scores"])) <= LABELS and rec["truncated"] == "0"
        assert rec.get("meta") == sent[sid].get("meta")
        latest = json.loads(r.get(stream_env["TRIAGE_RESULT_KEY_PREFIX"] + rec["id"]))
        assert latest["status"] == "ok" and latest["label"] == rec["label"] and latest["stream_id"] == sid
        assert 0 < r.ttl(stream_env["TRIAGE_RESULT_KEY_PREFIX"] + rec["id"]) <= 86_400
    windows = worker.events("window")
    assert windows and sum(b["items"] for b in windows) >= len(texts)
    for key in (
        "passes",
        "real_tokens",
        "padded_tokens",
        "padding_pct",
        "prefix_tokens_reused",
        "read_ms",
        "tokenize_ms",
        "infer_ms",
        "write_ms",
        "items_per_s",
        "backlog",
        "latency_p50_ms",
        "latency_p99_ms",
    ):
        assert key in windows[-1], key
    # one "pass" line per forward call, tied to its window
    passes = worker.events("pass")
    per_window = {}
    for p in passes:
        per_window[p["window"]] = per_window.get(p["window"], 0) + 1
        assert p["items"] >= 1 and p["infer_ms"] >= 0 and p["padded_tokens"] >= p["real_tokens"] > 0
    assert all(per_window.get(w["window"], 0) == w["passes"] for w in windows), (per_window, windows)
    assert not worker.events("batch"), "the per-window line is called 'window' now"
    assert worker.returncode is None, worker.stderr_tail()


BAD = {
    "no-text": {"id": "bad-no-text", "body": "text is under the wrong name"},
    "empty": {"id": "bad-empty", "text": ""},
    "blank": {"id": "bad-blank", "text": "  \n\t "},
    "latin1": {"id": "bad-latin1", "text": "caf\u00e9 d\u00e9j\u00e0".encode("latin-1")},
    "binary": {"id": "bad-binary", "text": bytes(range(128, 256))},
    "oversized": {"id": "bad-oversized", "text": "x" * (MAX_TEXT_BYTES + 1)},
    "subject+text oversized": {"id": "bad-sum", "subject": "s" * 2000, "text": "t" * 1500},
    "meta not json": {"id": "bad-meta", "text": "hello", "meta": "{customer: 1"},
    "meta not object": {"id": "bad-meta-type", "text": "hello", "meta": "[1, 2, 3]"},
    "id not utf8": {"id": b"\xff\xfe", "text": "hello"},
    "id empty": {"id": "", "text": "hello"},
    "id newline": {"id": "two\nlines", "text": "hello"},
    "subject not utf8": {"id": "bad-subject", "subject": b"\xc3\x28", "text": "hello"},
}


def test_bad_inputs_are_dead_lettered_with_reasons_and_neighbours_classified(worker, stream_env, r):
    stream = stream_env["TRIAGE_INPUT_STREAM"]
    bad_ids, good = {}, {}
    for n, (kind, fields) in enumerate(BAD.items()):
        good[r.xadd(stream, {"id": f"good-before-{n}", "text": "refund my last invoice"})] = f"good-before-{n}"
        bad_ids[r.xadd(stream, fields)] = kind
    # handled, not rejected: unknown fields ignored, NUL and emoji kept, long text truncated by the engine (flagged)
    good[r.xadd(stream, {"id": "good-extra", "text": "login broken", "channel": "email", "priority": "9"})] = (
        "good-extra"
    )
    good[r.xadd(stream, {"id": "good-nul", "text": "odd \x00 bytes \U0001f600 but valid"})] = "good-nul"
    long_sid = r.xadd(stream, {"id": "good-long", "text": "my package is late again " * 60})
    good[long_sid] = "good-long"

    settled = wait_settled(r, stream_env, list(bad_ids) + list(good))
    for sid, kind in bad_ids.items():
        got, rec = settled[sid]
        assert got == "dead", (kind, rec)
        assert len(rec["reason"]) > 15 and rec["deliveries"] == "1", rec
        assert isinstance(json.loads(rec["payload"]), dict)
    reasons = {bad_ids[sid]: settled[sid][1]["reason"] for sid in bad_ids}
    assert "no 'text' field" in reasons["no-text"] and "not valid UTF-8" in reasons["latin1"]
    assert (
        f"over the limit of {MAX_TEXT_BYTES} bytes" in reasons["oversized"]
        and "not valid JSON" in reasons["meta not json"]
    )
    assert json.loads(settled[next(s for s, k in bad_ids.items() if k == "no-text")][1]["payload"])["body"].startswith(
        "text is"
    )
    for sid, tid in good.items():
        got, rec = settled[sid]
        assert got == "result" and rec["id"] == tid and rec["label"] in LABELS, rec
    assert settled[long_sid][1]["truncated"] == "1"
    # a caller waiting on a rejected ticket's key learns why
    assert json.loads(r.get(stream_env["TRIAGE_RESULT_KEY_PREFIX"] + "bad-empty"))["status"] == "dead_letter"
    assert worker.returncode is None, worker.stderr_tail()
    assert r.xpending(stream, "triage")["pending"] == 0


def test_dead_letter_keeps_a_bounded_excerpt_with_size_and_hash(worker, stream_env, r):
    """A ticket over TRIAGE_MAX_TEXT_BYTES is refused; its dead letter and latest-result key hold an excerpt of at
    most 4 KB (TRIAGE_DEAD_LETTER_EXCERPT_BYTES), the entry's size and a hash, not the ticket twice. (An entry too
    large to read, over 2 x TRIAGE_MAX_TEXT_BYTES + 4096, has no hash: tests/integration/test_read_bound.py.)"""
    stream = stream_env["TRIAGE_INPUT_STREAM"]
    fields = {"id": "huge-1", "text": "x" * 9_000, "channel": "mail"}  # read whole: at most 2 x 3000 + 4096 bytes
    huge = r.xadd(stream, fields)
    blank = r.xadd(stream, {"id": "blank-1", "text": "  "})
    settled = wait_settled(r, stream_env, [huge, blank], timeout_s=60)
    kind, rec = settled[huge]
    assert kind == "dead" and "over the limit" in rec["reason"], rec["reason"]
    assert len(rec["payload"].encode()) <= 4096 and rec["payload_truncated"] == "1"
    excerpt = json.loads(rec["payload"])
    assert excerpt["id"] == "huge-1" and excerpt["channel"] == "mail" and excerpt["text"].startswith("xxxx")
    raw = [(k.encode(), v.encode()) for k, v in fields.items()]
    assert int(rec["payload_bytes"]) == sum(len(k) + len(v) for k, v in raw)
    digest = hashlib.sha256(b"".join(b"%d:%s,%d:%s," % (len(k), k, len(v), v) for k, v in raw)).hexdigest()
    assert rec["payload_sha256"] == digest
    key = stream_env["TRIAGE_RESULT_KEY_PREFIX"] + "huge-1"
    assert json.loads(r.get(key))["status"] == "dead_letter" and r.strlen(key) < 8192
    assert sum(len(k) + len(v) for k, v in rec.items()) < 8192  # the dead-letter entry itself
    kind, rec = settled[blank]
    assert kind == "dead" and rec["payload_truncated"] == "0"
    assert json.loads(rec["payload"]) == {"id": "blank-1", "text": "  "}


@pytest.mark.parametrize("order", ["blank-then-good", "good-then-blank"])
def test_latest_result_key_follows_entry_order_within_one_window(worker, stream_env, r, order):
    """Two entries with the same ticket id read in one window: the key holds the later entry's outcome."""
    stream, tid = stream_env["TRIAGE_INPUT_STREAM"], f"same-{order}"
    entries = [{"id": tid, "text": "   "}, {"id": tid, "text": "I was charged twice"}]
    if order == "good-then-blank":
        entries.reverse()
    pipe = r.pipeline(transaction=True)  # arrive together: one read, one window, one write
    for fields in entries:
        pipe.xadd(stream, fields)
    first, second = pipe.execute()
    settled = wait_settled(r, stream_env, [first, second])
    latest = json.loads(r.get(stream_env["TRIAGE_RESULT_KEY_PREFIX"] + tid))
    assert latest["stream_id"] == second, (order, latest)
    assert latest["status"] == ("ok" if order == "blank-then-good" else "dead_letter")
    assert {kind for kind, _ in settled.values()} == {"result", "dead"}


def test_an_older_entry_written_later_does_not_replace_the_latest_result(worker, stream_env, r):
    """The key answers the entry with the highest stream id: an older entry with the same ticket id that is
    written later (reclaimed from a dead consumer here; a later pass of a window does the same) leaves it."""
    stream, tid = stream_env["TRIAGE_INPUT_STREAM"], "reclaimed-late"
    pipe = r.pipeline(transaction=True)  # the older entry goes to a consumer that dies with it
    pipe.xadd(stream, {"id": tid, "text": "where is my parcel?"})
    pipe.xreadgroup("triage", "ghost-late", {stream: ">"}, count=1)
    older, delivered = pipe.execute()
    assert delivered[0][1][0][0] == older
    newer = r.xadd(stream, {"id": tid, "text": "   "})  # the live worker dead-letters it at once
    wait_settled(r, stream_env, [newer], timeout_s=30)
    assert json.loads(r.get(stream_env["TRIAGE_RESULT_KEY_PREFIX"] + tid))["stream_id"] == newer
    settled = wait_settled(r, stream_env, [older], timeout_s=30)  # reclaimed after TRIAGE_CLAIM_IDLE_MS, classified
    assert settled[older][0] == "result"
    latest = json.loads(r.get(stream_env["TRIAGE_RESULT_KEY_PREFIX"] + tid))
    assert latest["stream_id"] == newer and latest["status"] == "dead_letter", latest


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_redis_cli_round_trip(worker, stream_env, redis_url):
    url = redis_url
    sid = subprocess.run(
        [
            "redis-cli",
            "-u",
            url,
            "XADD",
            stream_env["TRIAGE_INPUT_STREAM"],
            "*",
            "id",
            "cli-1",
            "text",
            "I was charged twice",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["redis-cli", "-u", url, "--no-raw", "XRANGE", stream_env["TRIAGE_RESULTS_STREAM"], "-", "+"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if sid in out:
            break
        time.sleep(0.2)
    assert sid in out and '"cli-1"' in out and '"label"' in out
    key = subprocess.run(
        ["redis-cli", "-u", url, "GET", stream_env["TRIAGE_RESULT_KEY_PREFIX"] + "cli-1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(key)["label"] in LABELS


def test_poison_entry_past_max_deliveries_is_dead_lettered(worker, stream_env, r):
    """A consumer that read an entry and died, twice claimed by others that died too: the live
    worker reclaims it (XAUTOCLAIM) and parks it instead of running it a 4th time."""
    stream = stream_env["TRIAGE_INPUT_STREAM"]

    # Added, read by "ghost" and claimed again `claims` times in one script: the live worker (TRIAGE_CLAIM_IDLE_MS
    # is 300 ms) can neither read it first nor reclaim it between two deliveries (as 2, not past the limit)
    deliver = r.register_script(
        """
        local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
        redis.call('XREADGROUP', 'GROUP', 'triage', 'ghost', 'COUNT', 1, 'STREAMS', KEYS[1], '>')
        for _ = 1, tonumber(ARGV[1]) do redis.call('XCLAIM', KEYS[1], 'triage', 'ghost', 0, id) end
        return id
        """
    )

    def add_and_deliver_to_ghost(fields, claims=0):
        return deliver(keys=[stream], args=[claims, *(x for kv in fields.items() for x in kv)])

    poison = add_and_deliver_to_ghost({"id": "poison", "text": "this one kills workers"}, claims=2)
    survivor = add_and_deliver_to_ghost({"id": "survivor", "text": "charged twice"})
    settled = wait_settled(r, stream_env, [poison, survivor], timeout_s=30)
    kind, rec = settled[poison]
    assert kind == "dead" and rec["id"] == "poison" and rec["deliveries"] == "4", rec
    assert "delivered 4 times, more than TRIAGE_MAX_DELIVERIES=2" in rec["reason"]
    kind, rec = settled[survivor]
    assert kind == "result" and rec["worker"] == stream_env["TRIAGE_CONSUMER"], rec
    assert worker.events("entries_claimed")
    assert r.xpending(stream, "triage")["pending"] == 0


def test_healthcheck_exit_codes(worker, stream_env):
    ok = run_cli(stream_env, "healthcheck", "--consumer", stream_env["TRIAGE_CONSUMER"], "--host", socket.gethostname())
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[0])["consumer"] == stream_env["TRIAGE_CONSUMER"]
    assert run_cli(stream_env, "healthcheck", "--consumer", "nobody-here").returncode == 1
    assert run_cli(stream_env, "healthcheck", "-q", "--host", "elsewhere.invalid").returncode == 1


def test_a_second_process_under_the_same_consumer_name_exits_2_and_leaves_the_first_alone(worker, stream_env, r):
    """Two processes under one TRIAGE_CONSUMER would re-read each other's pending entries (duplicates, delivery
    counts towards the poison limit): the second is refused before it loads the model, as rq refuses a live name."""
    second = run_cli(stream_env, "run")
    assert second.returncode == 2, second.stderr[-2000:]
    refused = [json.loads(x) for x in second.stderr.splitlines() if '"consumer_in_use"' in x]
    assert refused and refused[0]["holder_pid"] == worker.pid, second.stderr[-2000:]
    assert "TRIAGE_CONSUMER" in refused[0]["fix"]
    assert not any('"model_loaded"' in x for x in second.stderr.splitlines())
    assert worker.returncode is None
    beat = json.loads(r.get(stream_env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + stream_env["TRIAGE_CONSUMER"]))
    assert beat["pid"] == worker.pid


def test_summary_lines_and_warm_stop(worker, stream_env, r):
    """A worker of its own on the same stream (it is stopped here: the module's worker stays, in any order)."""
    env = env_with(stream_env, TRIAGE_CONSUMER=stream_env["TRIAGE_CONSUMER"] + "-stopped")
    own = start_worker(env)
    try:
        r.xadd(env["TRIAGE_INPUT_STREAM"], {"id": "warm-stop", "text": "I was charged twice"})
        own.wait_for("summary", timeout_s=10)
        assert own.stop() == 0, own.stderr_tail()
    finally:
        own.kill()
    stopped = own.events("worker_stopped")[-1]
    assert stopped["reason"] == "signal SIGTERM"
    assert r.get(env["TRIAGE_HEARTBEAT_KEY_PREFIX"] + env["TRIAGE_CONSUMER"]) is None
    # nothing pending and the reader stopped: its consumer name leaves the group (no trail of dead names)
    consumers = [c["name"] for c in r.xinfo_consumers(env["TRIAGE_INPUT_STREAM"], "triage")]
    assert env["TRIAGE_CONSUMER"] not in consumers, consumers
    assert run_cli(env, "healthcheck", "-q", "--consumer", env["TRIAGE_CONSUMER"]).returncode == 1
    # structlog JSON only on stderr: no stray progress bars or prints
    assert all(line.startswith("{") for line in own.lines), [x for x in own.lines if not x.startswith("{")][:3]
    assert worker.returncode is None  # the module's worker runs on
