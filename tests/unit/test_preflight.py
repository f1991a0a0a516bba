"""worker.preflight: unknown TRIAGE_ names, values named by their env var, Redis URLs, task files."""

from __future__ import annotations

import pytest

from worker import preflight
from worker.engine.task import TaskError, load_task_file
from worker.redact import url_secrets
from worker.settings import Settings

BAD_URL = "redis://:s3cret@host:notaport/0"


# ----------------------------------------------------------------- unit: names and values
def test_unknown_triage_variable_gets_a_did_you_mean():
    env = {"TRIAGE_MAX_BATCH_ITEM": "3", "TRIAGE_MODEL": "x", "PATH": "/bin"}
    (p,) = preflight.unknown_env(env)
    assert p.where == "TRIAGE_MAX_BATCH_ITEM" and "did you mean TRIAGE_MAX_BATCH_ITEMS?" in str(p)


def test_known_families_do_not_trip_the_unknown_check():
    env = {
        "TRIAGE_INPUT_MAX_BACKLOG": "5",
        "TRIAGE_BACKPRESSURE": "refuse",
        "TRIAGE_WAIT_POLL_MAX_MS": "10",  # producer-only
        "TRIAGE_MAX_BATCH_ITEMS": "8",
        "TRIAGE_BATCH_OVERHEAD_TOKENS": "4",  # deprecated aliases
        "TRIAGE_WINDOW_MAX_ITEMS": "8",
        "TRIAGE_PASS_MAX_TOKENS": "512",  # their new names
        "TRIAGE_TEST_REDIS_URL": "redis://x",
        "TRIAGE_CHAOS_SCALE": "quick",
        "TRIAGE_DATA_DIR": "/d",
    }
    assert preflight.unknown_env(env) == []


def test_kubernetes_service_links_are_not_unknown_settings_but_a_lone_port_variable_is():
    """A Service named triage-redis gives every pod of its namespace these; the worker exited 2 on them."""
    links = {
        "TRIAGE_REDIS_SERVICE_HOST": "10.0.0.12",
        "TRIAGE_REDIS_SERVICE_PORT": "6379",
        "TRIAGE_REDIS_SERVICE_PORT_REDIS": "6379",
        "TRIAGE_REDIS_PORT": "tcp://10.0.0.12:6379",
        "TRIAGE_REDIS_PORT_6379_TCP": "tcp://10.0.0.12:6379",
        "TRIAGE_REDIS_PORT_6379_TCP_PROTO": "tcp",
        "TRIAGE_REDIS_PORT_6379_TCP_PORT": "6379",
        "TRIAGE_REDIS_PORT_6379_TCP_ADDR": "10.0.0.12",
    }
    assert preflight.unknown_env(links) == []
    (p,) = preflight.unknown_env({"TRIAGE_REDIS_PORT": "6380"})  # no Service behind it: a mistake
    assert p.where == "TRIAGE_REDIS_PORT"


def test_a_setting_overwritten_by_a_service_link_says_so(monkeypatch):
    """A Service named triage-metrics sets TRIAGE_METRICS_PORT=tcp://...: the reason names the Service."""
    monkeypatch.setenv("TRIAGE_METRICS_SERVICE_HOST", "10.0.0.9")
    monkeypatch.setenv("TRIAGE_METRICS_PORT", "tcp://10.0.0.9:9108")
    _, problems = preflight.load_settings(Settings, unknown=True)
    (p,) = problems
    assert p.where == "TRIAGE_METRICS_PORT" and "Service triage-metrics" in str(p) and "enableServiceLinks" in str(p)


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
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "need rediss://"),
        ("redis://127.0.0.1:6379/0?sockettimeout=5", "'sockettimeout'"),
        ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements Flag: bogus"),
        ("redis://127.0.0.1:6379/0?protocol=5", "protocol must be either 2 or 3"),
    ],
)
def test_malformed_redis_urls(url, words):
    p = preflight.redis_url_problem(url)
    assert p is not None and p.where == "TRIAGE_REDIS_URL" and words in str(p)


def test_a_password_that_breaks_the_url_is_named_as_such_and_no_piece_of_it_is_shown():
    """redis-py's own message quotes what it misread as the port: "Xk9", a piece of the password."""
    p = preflight.redis_url_problem("redis://:Xk9/aB3+Zq7/pL2w@127.0.0.1:6379/0")
    assert p is not None and "percent-encode" in str(p)
    assert not any(piece in str(p) for piece in ("Xk9", "aB3", "Zq7", "pL2w")), str(p)


@pytest.mark.parametrize("url", ["redis://:Qx7?c=dZ9@127.0.0.1:6379/0", "redis://u:Qx7?c=dZ9@127.0.0.1:6379/0"])
def test_a_password_holding_a_query_shape_is_named_as_such_and_no_piece_of_it_is_shown(url):
    """An unencoded "?c=" in a password reads as the query: the mask's shapes stop there, and the URL was printed
    whole; the password is also registered, so no other output shows it."""
    p = preflight.redis_url_problem(url)
    assert p is not None and "percent-encode" in str(p)
    assert not any(piece in str(p) for piece in ("Qx7", "dZ9")), str(p)
    assert "Qx7?c=dZ9" in url_secrets(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://:pw@h:6380/1?ssl_cert_reqs=none",
        "unix:///tmp/r.sock?db=2",
        "redis://h/0?password=x",
    ],
)
def test_good_redis_urls(url):
    assert preflight.redis_url_problem(url) is None


# ----------------------------------------------------------------- unit: the task file
@pytest.mark.parametrize(
    "name, text, words",
    [
        (
            "typo.yaml",
            "labels:\n  - name: billing\n    descripton: money\n  - tech\n",
            "typo.yaml:3: unknown key 'descripton' in label 1 (did you mean 'description'?)",
        ),
        (
            "top.yaml",
            "labels: [a, b]\nexampels: []\n",
            "top.yaml:2: unknown key 'exampels' in the task file (did you mean 'examples'?)",
        ),
        (
            "notext.yaml",
            "labels: [a, b]\nexamples:\n  - {text: hi, label: a}\n  - {label: b}\n",
            "notext.yaml:4: example 2 has no 'text'",
        ),
        ("broken.yaml", "labels: [a, b\nexamples: []\n", "broken.yaml:2:"),
        ("bad.json", '{"labels": ["a", "b",]}', "bad.json:1:"),
        ("nolabel.yaml", "labels: [a, b]\nexamples:\n  - {text: hi, label: c}\n", "example label 'c' is not one of"),
        (
            "dupmap.yaml",
            "labels:\n  billing: a\n  technical: b\n  billing: c\n",
            "dupmap.yaml:4: the key 'billing' appears",
        ),
        (
            "duptop.yaml",
            "labels: [x, y]\nexamples: []\nlabels: [a, b]\n",
            "duptop.yaml:3: the key 'labels' appears twice",
        ),
        ("dup.json", '{"labels": ["a", "b"], "labels": ["c", "d"]}', "the key 'labels' appears twice"),
        ("case.yaml", "labels: [billing, Billing]\n", "labels 'billing' and 'Billing' differ only in case"),
        ("number.json", '{"labels": {"a": "x", "b": 2}}', "expected text, got 2"),
        ("unhashable.yaml", "labels:\n  ? [a, b]\n  : x\n  c: y\n", "unhashable.yaml:2:5: not valid YAML"),
    ],
)
def test_task_file_errors_name_the_file_and_line(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TaskError) as info:
        load_task_file(path)
    assert words in str(info.value) and "<unicode string>" not in str(info.value)
    assert str(path) in str(info.value)


def test_task_file_values_are_the_text_written(tmp_path):
    """YAML 1.1 would turn a label ``yes`` into True (named "True") and merge ``1.0`` into it; names are stripped
    as TRIAGE_LABELS strips them, so an example's label matches its label written with a stray space."""
    path = tmp_path / "text.yaml"
    path.write_text(
        "labels:\n  yes: agrees\n  no: refuses\n  1.0: version one\n  'off ': switched off\n"
        "examples:\n  - {text: 2024-01-01, label: ' off'}\n"
    )
    task = load_task_file(path)
    assert task.labels == ("yes", "no", "1.0", "off")
    assert task.descriptions == {"yes": "agrees", "no": "refuses", "1.0": "version one", "off": "switched off"}
    assert [(e.text, e.label) for e in task.examples] == [("2024-01-01", "off")]


def test_a_merge_key_still_merges_and_the_mapping_may_override_what_it_brings(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("labels: [a, b]\nexamples:\n  - &e {text: hi, label: a}\n  - <<: *e\n    label: b\n")
    assert [(e.text, e.label) for e in load_task_file(path).examples] == [("hi", "a"), ("hi", "b")]


@pytest.mark.parametrize(
    "url, piece",
    [
        ("redis://bob:ab@HostLikeFragment#x@127.0.0.1:6394/0", "HostLikeFragment"),  # redis-py's host: a piece
        ("redis://carol:ab@cd:LongFragmentSecret/x?y=z@127.0.0.1:6394/0", "LongFragmentSecret"),  # urllib's port text
    ],
)
def test_a_password_cut_by_hash_or_query_is_refused_without_echoing_a_piece_of_it(url, piece, monkeypatch):
    """Both URLs are read with a piece of the password as the host or the port: one passed the check (then every
    connection error named the piece), the other's problem quoted it."""
    from worker import redact
    from worker.preflight import redis_url_problem

    monkeypatch.setattr(redact, "_known", set())
    problem = redis_url_problem(url)
    assert problem is not None and "percent-encode" in problem.message
    assert piece not in problem.message and piece.lower() not in problem.message


def test_a_head_file_that_is_no_head_of_this_version_is_a_problem_before_anything_loads(tmp_path):
    """`check` looked only for the file: a truncated, foreign or newer-format head passed it, and the worker then
    refused it at start. Its safetensors header says so, read without numpy or torch."""
    import json
    import struct

    from worker.quality.head_file import FORMAT, head_file_problem

    def safetensors(header: dict) -> bytes:
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw

    tensors = {t: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for t in ("mean", "std", "weight", "bias")}
    cases = {
        "empty": (b"", "not a safetensors file"),
        "text": (b"labels: [a, b]\n", "not a safetensors file"),
        "weights": (safetensors({"w": tensors["mean"]}), "no 'triage_head' metadata"),
        "newer": (safetensors({"__metadata__": {"triage_head": '{"format": "triage-head/2"}'}}), "triage-head/2"),
        "no tensors": (safetensors({"__metadata__": {"triage_head": json.dumps({"format": FORMAT})}}), "mean"),
        "head": (safetensors({"__metadata__": {"triage_head": json.dumps({"format": FORMAT})}, **tensors}), None),
    }
    for name, (content, why) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        got = head_file_problem(path)
        assert (got is None) if why is None else (why in (got or "")), (name, got)
