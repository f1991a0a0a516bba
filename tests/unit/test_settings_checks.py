"""Settings that cannot work are refused up front, named by their env var: empty names, unknown log levels,
infinite floats, a fill wait past the Redis socket timeout, stream keys that are one another, scorers the model
and task cannot run, head and task paths that are blank or directories (``worker.settings``, ``worker.preflight``)."""

from __future__ import annotations

import pytest

from worker import preflight
from worker.settings import Settings


def _problems(monkeypatch, **env: str) -> list[str]:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings, problems = preflight.load_settings(Settings, unknown=False)
    assert (settings is None) == bool(problems), problems
    return [str(p) for p in problems]


# ----------------------------------------------------------------- values
@pytest.mark.parametrize(
    "var",
    [
        "TRIAGE_CONSUMER",
        "TRIAGE_GROUP",
        "TRIAGE_INPUT_STREAM",
        "TRIAGE_RESULTS_STREAM",
        "TRIAGE_DEAD_LETTER_STREAM",
        "TRIAGE_RESULT_KEY_PREFIX",
        "TRIAGE_HEARTBEAT_KEY_PREFIX",
        "TRIAGE_MODEL",
        "TRIAGE_FALLBACK_LABEL",
    ],
)
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_name_is_refused_not_used(monkeypatch, var, value):
    """TRIAGE_CONSUMER= ran a worker named "" (heartbeat key = the bare prefix); TRIAGE_RESULT_KEY_PREFIX= made a
    ticket id the whole key name. Names with a default are never "unset" by an empty value: refused."""
    (problem,) = _problems(monkeypatch, **{var: value})
    assert problem.startswith(f"{var}: ") and "must not be empty" in problem


def test_a_consumer_given_on_the_command_line_must_not_be_empty_either():
    settings, problems = preflight.load_settings(Settings, unknown=False, consumer="")
    assert settings is None and [p.where for p in problems] == ["TRIAGE_CONSUMER"]


def test_log_level_must_be_a_level(monkeypatch):
    (problem,) = _problems(monkeypatch, TRIAGE_LOG_LEVEL="LOUD")  # used to become INFO silently
    assert problem.startswith("TRIAGE_LOG_LEVEL: ") and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in problem
    monkeypatch.setenv("TRIAGE_LOG_LEVEL", "debug")
    assert Settings().log_level == "DEBUG"
    monkeypatch.setenv("TRIAGE_LOG_LEVEL", "warn")
    assert Settings().log_level == "WARNING"


@pytest.mark.parametrize(
    "var", ["TRIAGE_RECONNECT_MAX_S", "TRIAGE_DRAIN_REDIS_TIMEOUT_S", "TRIAGE_LOG_SUMMARY_S", "TRIAGE_WINDOW_TARGET_S"]
)
@pytest.mark.parametrize("value", ["inf", "Infinity"])
def test_float_settings_must_be_finite(monkeypatch, var, value):
    (problem,) = _problems(monkeypatch, **{var: value})
    assert problem.startswith(f"{var}: ") and "finite" in problem


@pytest.mark.parametrize("var, field", [("TRIAGE_HEAD_PATH", "head_path"), ("TRIAGE_TASK_FILE", "task_file")])
def test_a_blank_path_is_unset(monkeypatch, var, field):
    """``TRIAGE_HEAD_PATH=`` (a blank .env line) became Path('.'), a directory that passed the file check."""
    monkeypatch.setenv(var, "")
    assert getattr(Settings(), field) is None


def test_redis_port_is_not_a_triage_variable():
    """docker-compose.yml reads REDIS_HOST_PORT; nothing reads TRIAGE_REDIS_PORT, so setting it is a mistake."""
    (p,) = preflight.unknown_env({"TRIAGE_REDIS_PORT": "6380"})
    assert p.where == "TRIAGE_REDIS_PORT" and "is not a triage setting" in str(p)


# ----------------------------------------------------------------- the worker's whole preflight
def _worker_problems(model_dir, **fields) -> list[preflight.Problem]:
    return preflight.worker_problems(Settings(model=str(model_dir), **fields))


def test_a_head_path_that_is_a_directory_is_refused(tiny_model_dir, tmp_path):
    (p,) = _worker_problems(tiny_model_dir, head_path=tmp_path)
    assert p.where == "TRIAGE_HEAD_PATH" and "is a directory, not a file" in str(p)


def test_a_missing_head_file_does_not_hide_a_bad_task(tiny_model_dir, tmp_path):
    """Task checks used to be skipped when any file check failed, and `check` then loaded the bad task itself."""
    task = tmp_path / "task.yaml"
    task.write_text("labels:\n  - billing\n")
    problems = _worker_problems(tiny_model_dir, task_file=task, head_path=tmp_path / "none.safetensors")
    assert [p.where for p in problems] == ["TRIAGE_HEAD_PATH", "TRIAGE_TASK_FILE"], problems
    assert "no such file" in str(problems[0]) and "at least two labels" in str(problems[1])


@pytest.mark.parametrize(
    "fields, where, words",
    [
        ({"scorer": "head"}, "TRIAGE_HEAD_PATH", "TRIAGE_SCORER=head needs it"),
        ({"scorer": "prompt", "bert": True}, "TRIAGE_SCORER", "needs a causal LM's label tokens"),
        ({"labels": "billing,technical", "bert": True}, "TRIAGE_HEAD_PATH", "none for ['billing', 'technical']"),
        ({"labels": "billing,technical", "encoder": True}, "TRIAGE_HEAD_PATH", "joined features"),
    ],
)
def test_a_scorer_that_cannot_work_is_found_before_the_model_loads(tiny_model_dir, tiny_bert_dir, fields, where, words):
    fields = dict(fields)
    model = tiny_bert_dir if fields.pop("bert", False) else tiny_model_dir
    if fields.pop("encoder", False):
        fields["encoder"] = str(tiny_bert_dir)
    (p,) = _worker_problems(model, **fields)
    assert p.where == where and words in str(p), p


def _head_header() -> bytes:
    import json
    import struct

    from worker.quality.head_file import FORMAT, TENSORS

    spec = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    header = {"__metadata__": {"triage_head": json.dumps({"format": FORMAT})}, **{t: spec for t in TENSORS}}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * 4


def test_scorers_that_can_work_pass(tiny_model_dir, tiny_bert_dir, tmp_path):
    head = tmp_path / "head.safetensors"  # a head of this version by its header; its fit is checked when loaded
    head.write_bytes(_head_header())
    assert _worker_problems(tiny_bert_dir) == []  # the built-in task has an example for every label
    assert _worker_problems(tiny_bert_dir, labels="a,b", head_path=head) == []
    assert _worker_problems(tiny_model_dir, labels="a,b") == []  # a causal LM scores label tokens
    assert _worker_problems(tiny_model_dir, scorer="head", head_path=head) == []


RECOVERY_KEY = "TRIAGE_INPUT_STREAM + ':recovery:' + TRIAGE_GROUP (the recovery-point key)"


@pytest.mark.parametrize(
    "fields, where",
    [
        ({"dead_letter_stream": "s:tickets"}, "TRIAGE_INPUT_STREAM / TRIAGE_DEAD_LETTER_STREAM"),
        ({"results_stream": "s:tickets"}, "TRIAGE_INPUT_STREAM / TRIAGE_RESULTS_STREAM"),
        ({"results_stream": "s:dead"}, "TRIAGE_RESULTS_STREAM / TRIAGE_DEAD_LETTER_STREAM"),
        ({"results_stream": "s:tickets:recovery:g"}, "TRIAGE_RESULTS_STREAM / TRIAGE_INPUT_STREAM"),
        ({"dead_letter_stream": "s:result:dead"}, "TRIAGE_DEAD_LETTER_STREAM / TRIAGE_RESULT_KEY_PREFIX"),
        ({"input_stream": "s:hb:tickets"}, "TRIAGE_INPUT_STREAM / TRIAGE_HEARTBEAT_KEY_PREFIX"),
        ({"heartbeat_key_prefix": "s:result:hb:"}, "TRIAGE_RESULT_KEY_PREFIX / TRIAGE_HEARTBEAT_KEY_PREFIX"),
        # a ticket with id "recovery:g" (a worker named so) would overwrite the recovery point: passed before
        ({"result_key_prefix": "s:tickets:"}, f"{RECOVERY_KEY} / TRIAGE_RESULT_KEY_PREFIX"),
        ({"heartbeat_key_prefix": "s:tickets:rec"}, f"{RECOVERY_KEY} / TRIAGE_HEARTBEAT_KEY_PREFIX"),
    ],
)
def test_the_worker_keys_must_not_be_one_another(tiny_model_dir, fields, where):
    """Dead letters into the input stream were read back as tickets forever; results into it clobbered it."""
    names = {
        "input_stream": "s:tickets",
        "results_stream": "s:results",
        "dead_letter_stream": "s:dead",
        "result_key_prefix": "s:result:",
        "heartbeat_key_prefix": "s:hb:",
        "group": "g",
    }
    assert _worker_problems(tiny_model_dir, **names) == []
    (p,) = _worker_problems(tiny_model_dir, **(names | fields))
    assert p.where == where, p
