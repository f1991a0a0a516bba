"""``triage-producer demo`` end to end: real Redis, the real worker subprocess (tiny model), the summary."""

from __future__ import annotations

import json
import subprocess
import sys

import redis


def test_demo_runs_end_to_end_and_cleans_up(triage_env, key_prefix, redis_url, tmp_path):
    ns = key_prefix + "demo:"
    summary_file = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "producer", "demo", "--n", "20", "--namespace", ns, "--json", str(summary_file)],
        env=triage_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    out = proc.stdout
    assert "=== triage demo summary ===" in out
    assert "classified      20 tickets" in out
    assert "dead-lettered   3 (of 3 deliberately bad tickets)" in out
    assert "text is empty" in out and "meta is not valid JSON" in out
    assert "cleaned up" in proc.stderr

    sm = json.loads(summary_file.read_text())
    assert sm["classified"] == 20 and sm["dead_lettered"] == 3
    assert sum(sm["labels"].values()) == 20
    assert set(sm["labels"]) <= {"billing", "technical", "account", "shipping", "other", "needs_review"}
    assert sm["model"] == triage_env["TRIAGE_MODEL"] and sm["device"] == "cpu" and sm["dtype"] == "fp32"
    assert sm["windows"] >= 1 and sm["passes"] >= sm["windows"] and 0 <= sm["padding_pct"] < 100
    assert sm["items_per_s_busy"] > 0 and sm["latency_p99_ms"] >= sm["latency_p50_ms"] >= 0
    assert 0 <= sm["agreement_with_intended_label"] <= 1

    client = redis.Redis.from_url(redis_url)
    assert not list(client.scan_iter(match=ns + "*"))  # its own keys are gone
    assert not client.exists(triage_env["TRIAGE_INPUT_STREAM"])  # and the configured streams were never touched


def test_demo_refuses_a_namespace_that_already_holds_keys_and_leaves_them(triage_env, key_prefix, redis_url):
    """It deletes everything under its namespace at the end, so a namespace in use (``--namespace triage``, the
    production prefix) is refused before anything is written or deleted."""
    client = redis.Redis.from_url(redis_url)
    client.set(key_prefix + "live:results", "someone else's")
    proc = subprocess.run(
        [sys.executable, "-m", "producer", "demo", "--n", "5", "--namespace", key_prefix],
        env=triage_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "already holds keys" in proc.stderr and "--namespace" in proc.stderr
    assert client.get(key_prefix + "live:results") == b"someone else's"
    assert not list(client.scan_iter(match=key_prefix + "tickets*"))  # nothing enqueued
