"""Configuration errors up front: one line naming the env var or file:line, exit 2, before any model load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.worker_proc import REPO, env_with, run_cli
from worker import preflight
from worker.engine.task import TaskError, load_task_file
from worker.settings import Settings

BAD_URL = "redis://:s3cret@host:notaport/0"


# ----------------------------------------------------------------- unit: names and values
def test_unknown_triage_variable_gets_a_did_you_mean():
    env = {"TRIAGE_MAX_BATCH_ITEM": "3", "TRIAGE_MODEL": "x", "PATH": "/bin"}
    (p,) = preflight.unknown_env(env)
    assert p.where == "TRIAGE_MAX_BATCH_ITEM" and "did you mean TRIAGE_MAX_BATCH_ITEMS?" in str(p)


def test_known_families_do_not_trip_the_unknown_check():
    env = {
        "TRIAGE_INPUT_MAX_BACKLOG": "5", "TRIAGE_BACKPRESSURE": "refuse", "TRIAGE_WAIT_POLL_MAX_MS": "10",  # producer-only
        "TRIAGE_MAX_BATCH_ITEMS": "8", "TRIAGE_BATCH_OVERHEAD_TOKENS": "4",  # deprecated aliases
        "TRIAGE_WINDOW_MAX_ITEMS": "8", "TRIAGE_PASS_MAX_TOKENS": "512",  # their new names
        "TRIAGE_TEST_REDIS_URL": "redis://x", "TRIAGE_CHAOS_SCALE": "quick", "TRIAGE_DATA_DIR": "/d", "TRIAGE_REDIS_PORT": "1",
    }
    assert preflight.unknown_env(env) == []


def test_invalid_value_is_named_by_its_env_var(monkeypatch):
    monkeypatch.setenv("TRIAGE_MAX_BATCH_ITEMS", "0")
    settings, problems = preflight.load_settings(Settings, unknown=False)
    assert settings is None and [p.where for p in problems] == ["TRIAGE_MAX_BATCH_ITEMS"]
    assert "greater than or equal to 1" in str(problems[0])


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://127.0.0.1:6379", "schemes"),
        ("redis://127.0.0.1:port/0", "Port"),
        ("redis://127.0.0.1:6379/zero", "database number"),
        ("redis:///0", "no host"),
        ("", "is empty"),
    ],
)
def test_malformed_redis_urls(url, words):
    p = preflight.redis_url_problem(url)
    assert p is not None and p.where == "TRIAGE_REDIS_URL" and words in str(p)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://:pw@h:6380/1?ssl_cert_reqs=none", "unix:///tmp/r.sock?db=2",
                                 "redis://h/0?password=x"])
def test_good_redis_urls(url):
    assert preflight.redis_url_problem(url) is None


# ----------------------------------------------------------------- unit: the task file
@pytest.mark.parametrize(
    "name, text, words",
    [
        ("typo.yaml", "labels:\n  - name: billing\n    descripton: money\n  - tech\n", "typo.yaml:3: unknown key 'descripton' in label 1 (did you mean 'description'?)"),
        ("top.yaml", "labels: [a, b]\nexampels: []\n", "top.yaml:2: unknown key 'exampels' in the task file (did you mean 'examples'?)"),
        ("notext.yaml", "labels: [a, b]\nexamples:\n  - {text: hi, label: a}\n  - {label: b}\n", "notext.yaml:4: example 2 has no 'text'"),
        ("broken.yaml", "labels: [a, b\nexamples: []\n", "broken.yaml:2:"),
        ("bad.json", '{"labels": ["a", "b",]}', "bad.json:1:"),
        ("nolabel.yaml", "labels: [a, b]\nexamples:\n  - {text: hi, label: c}\n", "example label 'c' is not one of"),
    ],
)
def test_task_file_errors_name_the_file_and_line(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TaskError) as info:
        load_task_file(path)
    assert words in str(info.value) and "<unicode string>" not in str(info.value)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------- real processes
def _producer(env, *args):
    return subprocess.run([sys.executable, "-m", "producer", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_malformed_redis_url_is_one_line_and_exit_2_everywhere(triage_env):
    env = env_with(triage_env, TRIAGE_REDIS_URL=BAD_URL)
    for name, r in (("run", run_cli(env, "run")), ("healthcheck", run_cli(env, "healthcheck")),
                    ("producer", _producer(env, "backlog")), ("check", run_cli(env, "check"))):
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        if name == "check":
            lines = [x for x in lines if x.startswith("error:")]
        assert r.returncode == 2, (name, r.stderr)
        assert len(lines) == 1 and "TRIAGE_REDIS_URL" in lines[0] and "notaport" in lines[0], (name, r.stderr)
        assert "s3cret" not in r.stderr + r.stdout and "Traceback" not in r.stderr
    run_line = json.loads(run_cli(env, "run").stderr.splitlines()[0])  # JSON logs: the error is a JSON line too
    assert run_line["event"] == "config_invalid" and run_line["setting"] == "TRIAGE_REDIS_URL"


def test_run_refuses_unknown_variables_and_bad_task_files_before_loading_the_model(triage_env, tmp_path):
    r = run_cli(env_with(triage_env, TRIAGE_MAX_BATCH_ITEM=3), "run")
    recs = [json.loads(x) for x in r.stderr.splitlines()]
    assert r.returncode == 2 and [x["event"] for x in recs] == ["config_invalid"]
    assert "did you mean TRIAGE_MAX_BATCH_ITEMS?" in recs[0]["error"]
    task = tmp_path / "task.yaml"
    task.write_text("labels:\n  - name: a\n  - name: b\nexamples:\n  - {txt: hi, label: a}\n")
    r = run_cli(env_with(triage_env, TRIAGE_TASK_FILE=task), "run")
    recs = [json.loads(x) for x in r.stderr.splitlines()]
    assert r.returncode == 2 and [x["event"] for x in recs] == ["config_invalid"]
    assert f"{task}:5: unknown key 'txt' in example 1 (did you mean 'text'?)" in recs[0]["error"]


def test_check_command(triage_env, tmp_path):
    ok = run_cli(triage_env, "check")
    assert ok.returncode == 0, ok.stderr
    assert "redis:" in ok.stdout and "reachable" in ok.stdout and "task: 5 labels" in ok.stdout
    loaded = run_cli(triage_env, "check", "--model", timeout_s=300)
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded on cpu" in loaded.stdout
    bad = run_cli(env_with(triage_env, TRIAGE_REDIS_URL="redis://127.0.0.1:1/0", TRIAGE_LABELS="only-one",
                           TRIAGE_MODEL=str(tmp_path / "nope")), "check")
    errors = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert bad.returncode == 2
    assert {e.split(":")[1].strip() for e in errors} == {"TRIAGE_REDIS_URL", "TRIAGE_LABELS", "TRIAGE_MODEL"}, bad.stderr
