"""Security: TLS (rediss://) with a password against a test-owned server, credentials never in
the logs, and a static check that no code path can run payload content (no pickle, no
eval/exec, no trust_remote_code=True, no unsafe YAML or torch.load, no shell=True).

Password + least-privilege ACL user + masking during an outage are covered by
test_redis_restart.py (same worker run, to keep the suite's process starts down).
"""

from __future__ import annotations

import io
import os
import sys
import tokenize
from pathlib import Path

import pytest

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import push, read_stream, record, synth_tickets
from tests.integration.chaos.redis_server import make_tls_files, server_supports_tls
from tests.worker_proc import run_clis

REPO = Path(__file__).resolve().parents[3]
SOURCE_DIRS = ("worker", "producer", "bench", "scripts")

# module or attribute names whose use means "deserialize or run arbitrary code"
FORBIDDEN_NAMES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile"}  # builtins called directly
FORBIDDEN_ATTRS = {
    ("os", "system"),
    ("os", "popen"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
    ("yaml", "full_load"),
    ("torch", "load"),
    ("np", "load"),
    ("numpy", "load"),
}

# np.load / torch.load are fine when the call itself switches unpickling off
SAFE_LOAD_ARGS = {("allow_pickle", "False"), ("weights_only", "True")}


def _call_args(toks, i: int) -> set[tuple[str, str]]:
    """``(name, value)`` keyword pairs of the call whose "(" is ``toks[i]``."""
    if i >= len(toks) or toks[i].string != "(":
        return set()
    depth, pairs = 0, set()
    for j in range(i, len(toks)):
        s = toks[j].string
        depth += s in "([{" and len(s) == 1
        depth -= s in ")]}" and len(s) == 1
        if depth == 0:
            break
        if depth == 1 and s == "=" and j + 1 < len(toks):
            pairs.add((toks[j - 1].string, toks[j + 1].string))
    return pairs


def _python_files() -> list[Path]:
    files = []
    for d in SOURCE_DIRS:
        if (REPO / d).is_dir():
            files += sorted(p for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)
    return files


def _violations(path: Path) -> list[str]:
    """Token-level scan: comments and strings (docstrings saying "no pickle") do not count."""
    src = path.read_text(encoding="utf-8")
    toks = [
        t
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]
    out = []
    for i, t in enumerate(toks):
        prev = toks[i - 1].string if i else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        where = f"{path.relative_to(REPO)}:{t.start[0]}"
        if t.type != tokenize.NAME:
            continue
        if t.string in FORBIDDEN_NAMES:
            out.append(f"{where}: uses {t.string}")
        if t.string in FORBIDDEN_CALLS and nxt == "(" and prev not in (".", "def"):
            out.append(f"{where}: calls {t.string}()")
        if prev == "." and i >= 2 and (toks[i - 2].string, t.string) in FORBIDDEN_ATTRS:
            if not (t.string == "load" and _call_args(toks, i + 1) & SAFE_LOAD_ARGS):
                out.append(f"{where}: calls {toks[i - 2].string}.{t.string}")
        if t.string == "trust_remote_code" and nxt == "=" and i + 2 < len(toks) and toks[i + 2].string != "False":
            out.append(f"{where}: trust_remote_code={toks[i + 2].string}")
        if t.string == "shell" and nxt == "=" and i + 2 < len(toks) and toks[i + 2].string != "False":
            out.append(f"{where}: shell={toks[i + 2].string}")
    return out


def test_no_code_path_can_run_payload_content():
    files = _python_files()
    assert len(files) > 20, "source tree not found"
    found = [v for f in files for v in _violations(f)]
    assert found == [], "\n".join(found)


def test_the_scanner_catches_what_it_looks_for(tmp_path, monkeypatch):
    """The check above is only worth something if it fires: feed it each forbidden pattern."""
    bad = tmp_path / "worker" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "import pickle\nx = eval(s)\nexec(code)\nm = f(trust_remote_code=True)\nos.system('x')\n"
        "yaml.load(s)\ntorch.load(p)\nrun(cmd, shell=True)\n# pickle in a comment is fine\nmodel.eval()\n"
        "np.load(p, allow_pickle=False)\ntorch.load(p, map_location='cpu', weights_only=True)\n"
        "np.load(p, allow_pickle=True)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    got = _violations(bad)
    assert len(got) == 9, got  # the two safe loads do not count


def test_model_is_a_setting_never_a_message_field():
    from worker.stream.messages import KNOWN_FIELDS

    assert set(KNOWN_FIELDS) == {"text", "id", "subject", "meta"}  # nothing a producer sends picks code or weights


@pytest.mark.skipif(not server_supports_tls(), reason="the installed redis-server was built without TLS")
def test_tls_with_password(launch, redis_server_factory, tiny_model_dir, tmp_path):
    """rediss:// + password + CA file in the URL; the worker classifies, the logs hold no password."""
    password = "tls-Pa55/word@chaos"
    tls = make_tls_files(tmp_path / "tls")
    server = redis_server_factory(password=password, tls=tls)
    url = server.url
    assert url.startswith("rediss://") and f"ssl_ca_certs={tls.ca}" in url
    env = worker_env(tiny_model_dir, url, tmp_path)
    client = server.client()
    tickets = synth_tickets(50, seed=2, prefix="tls")
    push(client, env["TRIAGE_INPUT_STREAM"], tickets)
    w = launch(env, "run", "--drain")
    assert w.wait(timeout_s=300) == 0, w.stderr_tail()
    got = {f["id"] for _sid, f in read_stream(client, env["TRIAGE_RESULTS_STREAM"])}
    assert got == {t["id"] for t in tickets}
    output = "\n".join(w.lines + w.stdout_lines)
    assert password not in output and "Pa55" not in output
    assert "rediss://:***@127.0.0.1" in output
    # the server really refuses plaintext: a redis:// client cannot talk to it
    import redis

    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=server.port, password=password, socket_timeout=3).ping()
    record("tls", tickets=len(tickets), results=len(got), password_in_logs=False)


def test_wrong_password_is_retried_and_never_logged(launch, redis_server_factory, tiny_model_dir, tmp_path):
    """A wrong password is an AuthenticationError (a ConnectionError in redis-py): the worker keeps
    retrying with backoff (documented); neither the wrong nor the right password appears in its output."""
    right, wrong = "r1ght-Pa55word", "Wr0ng-Pa55word"
    server = redis_server_factory(password=right)
    env = worker_env(tiny_model_dir, server.url_as(password=wrong), tmp_path, TRIAGE_RECONNECT_MAX_S=0.5)
    w = launch(env, ready=False)
    try:
        w.wait_for(
            lambda r: r.get("event") == "redis_unavailable" and "AuthenticationError" in str(r.get("error")),
            timeout_s=120,
        )
        w.wait_for(lambda r: r.get("event") == "redis_unavailable" and r.get("attempt", 0) >= 3, timeout_s=60)
        assert w.returncode is None, "the worker gave up"
    finally:
        w.kill()
    output = "\n".join(w.lines + w.stdout_lines)
    assert wrong not in output and right not in output and "Pa55word" not in output


SECRET = "s3cr3T-Pw/x@y:z"  # "/", "@", ":" need percent-encoding in a URL
SECRET_ENC = "s3cr3T-Pw%2Fx%40y%3Az"
SECRET_CORE = "s3cr3T-Pw"  # what must not appear, in any encoding


def _url_forms(port: int) -> dict[str, str]:
    return {
        "userinfo": f"redis://default:{SECRET_ENC}@127.0.0.1:{port}/0",
        "no-user": f"redis://:{SECRET_ENC}@127.0.0.1:{port}/0",
        "query": f"redis://127.0.0.1:{port}/0?password={SECRET_ENC}",
        "query-user": f"redis://127.0.0.1:{port}/0?username=default&password={SECRET_ENC}",
    }


def _assert_no_secret(where: str, text: str) -> None:
    for line in text.splitlines():
        assert SECRET_CORE not in line and SECRET_ENC not in line, f"{where} printed the password: {line[:300]}"


def test_password_never_reaches_any_output(launch, redis_server_factory, tiny_model_dir, tmp_path):
    """Every URL form, every output path of real processes: the worker's JSON log (worker_starting, a run),
    a console-format start-up failure with its traceback (no locals), healthcheck (live and unreachable),
    producer errors, and the RQ batch worker. Each printed line is scanned for the password."""
    from worker.redis_server import free_port

    server = redis_server_factory(password=SECRET)
    forms = _url_forms(server.port)
    dead = _url_forms(free_port())
    dead["unix"] = f"unix://{tmp_path}/no-such.sock?db=0&password={SECRET_ENC}"
    # an encoded "=" (a query built with quote()): redis-py sends no password, the text still holds it
    dead["encoded-eq"] = f"redis://127.0.0.1:{server.port}/0?username=default&password%3D{SECRET_ENC}"
    client = server.client(decode_responses=True)

    # 1. the worker, JSON logs, the issue's ?password= form: start, classify, drain
    env = worker_env(tiny_model_dir, forms["query"], tmp_path)
    push(client, env["TRIAGE_INPUT_STREAM"], synth_tickets(5, prefix="pw"))
    w = launch(env, "run", "--drain")
    assert w.wait(timeout_s=300) == 0, w.stderr_tail()
    _assert_no_secret("worker run", "\n".join(w.lines + w.stdout_lines))
    starting = [r for r in w.logs if r.get("event") == "worker_starting"]
    assert starting and "password=***" in starting[0]["redis_url"]

    # 2. a start-up failure on the console renderer (what a terminal shows): traceback, never its locals
    broken = tmp_path / "broken-model"
    broken.mkdir()
    # a config the preflight accepts (a causal LM) but no weights or tokenizer: the load itself fails
    (broken / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    runs = {}  # label: (env, argv), run four at a time below
    for name, url in forms.items():
        env_c = {**env, "TRIAGE_REDIS_URL": url, "TRIAGE_LOG_FORMAT": "console", "TRIAGE_MODEL": str(broken)}
        runs[f"console start-up failure ({name})"] = (env_c, ["worker", "run", "--drain"])

    # 3. healthcheck against the live server (prints heartbeats) and unreachable ones (prints the error)
    every = {**forms, **{f"dead-{k}": v for k, v in dead.items()}}
    for name, url in every.items():
        runs[f"healthcheck ({name})"] = ({**env, "TRIAGE_REDIS_URL": url}, ["worker", "healthcheck"])

    # 4. producer commands, by env var and by --redis-url, reachable and not
    for name, url in every.items():
        for args in (["backlog"], ["--redis-url", url, "backlog"]):
            runs[f"producer {' '.join(args[:1])} ({name})"] = ({**env, "TRIAGE_REDIS_URL": url}, ["producer", *args])

    for label, r in run_clis(runs, timeout_s=120).items():
        _assert_no_secret(label, r.stdout + r.stderr)
        if label.startswith("console start-up failure"):
            assert r.returncode != 0, label
            assert "Traceback" in r.stderr or "Error" in r.stderr, r.stderr[-2000:]

    # 5. the RQ batch worker (RQ's CLI, its logs routed through triage's chain)
    rq_cli = str(Path(sys.executable).with_name("rq"))
    import subprocess

    r = subprocess.run(
        [
            rq_cli,
            "worker",
            "--worker-class",
            "worker.rqbatch.BatchWorker",
            "--burst",
            "--url",
            forms["query-user"],
            "--name",
            "pw-test-" + env["TRIAGE_INPUT_STREAM"].split(":")[1],
            env["TRIAGE_INPUT_STREAM"] + "-rq",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_no_secret("rq batch worker", r.stdout + r.stderr)


def test_a_redis_that_refuses_the_credentials_is_not_replaced_by_a_private_one(redis_server_factory):
    """The bench and the demo took a refused password for "no Redis here" and quietly ran against a private
    server: a misconfiguration hidden, and figures from another Redis."""
    from worker.redis_server import RedisRefused, answers, redis_or_private

    server = redis_server_factory(password=SECRET)
    wrong = f"redis://:wrong-Pw9@127.0.0.1:{server.port}/0"
    with pytest.raises(RedisRefused) as refused:
        answers(wrong)
    assert "refuses it" in str(refused.value) and "wrong-Pw9" not in str(refused.value)
    with pytest.raises(RedisRefused), redis_or_private(wrong):
        pass
    assert answers(f"redis://:{SECRET_ENC}@127.0.0.1:{server.port}/0")


def test_a_url_with_a_typo_in_its_scheme_never_prints_its_password(tmp_path):
    """No URL shape matches these, and "not a usable Redis URL (got '...')" printed the password in clear in check,
    run's config_invalid line, status, healthcheck and the producer."""
    runs = {}
    for url in ("tw:Us3rPWzz@127.0.0.1:6391", "redis:/tw:Us3rPWzz@127.0.0.1:6391/0", "redis//tw:Us3rPWzz@h:6391/0"):
        env = {"TRIAGE_REDIS_URL": url, "TRIAGE_LOG_FORMAT": "json", "PATH": os.environ["PATH"]}
        for argv in (["worker", "check", "--no-redis"], ["worker", "run"], ["worker", "status"]):
            runs[f"{' '.join(argv)} ({url})"] = (env, argv)
        runs[f"healthcheck ({url})"] = (env, ["worker", "healthcheck"])
        runs[f"producer backlog ({url})"] = (env, ["producer", "backlog"])
    for label, r in run_clis(runs, timeout_s=120).items():
        assert r.returncode != 0, label
        out = r.stdout + r.stderr
        assert "Us3rPWzz" not in out and "***" in out, (label, out[-600:])
