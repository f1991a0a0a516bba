"""Security: TLS (rediss://) with a password against a test-owned server, credentials never in
the logs, and a static check that no code path can run payload content (no pickle, no
eval/exec, no trust_remote_code=True, no unsafe YAML or torch.load, no shell=True).

Password + least-privilege ACL user + masking during an outage are covered by
test_redis_restart.py (same worker run, to keep the suite's process starts down).
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path

import pytest

from tests.chaos.conftest import worker_env
from tests.chaos.harness import push, record, read_stream, synth_tickets
from tests.chaos.redis_server import make_tls_files, server_supports_tls

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("worker", "producer", "bench", "scripts")

# module or attribute names whose use means "deserialize or run arbitrary code"
FORBIDDEN_NAMES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile"}  # builtins called directly
FORBIDDEN_ATTRS = {("os", "system"), ("os", "popen"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
                   ("torch", "load"), ("np", "load"), ("numpy", "load")}

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
    toks = [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
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
        "np.load(p, allow_pickle=False)\ntorch.load(p, map_location='cpu', weights_only=True)\nnp.load(p, allow_pickle=True)\n"
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
    url = server.url()
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
    env = worker_env(tiny_model_dir, server.url(password=wrong), tmp_path, TRIAGE_RECONNECT_MAX_S=0.5)
    w = launch(env, ready=False)
    try:
        w.wait_for(lambda r: r.get("event") == "redis_unavailable" and "AuthenticationError" in str(r.get("error")), timeout_s=120)
        w.wait_for(lambda r: r.get("event") == "redis_unavailable" and r.get("attempt", 0) >= 3, timeout_s=60)
        assert w.returncode is None, "the worker gave up"
    finally:
        w.kill()
    output = "\n".join(w.lines + w.stdout_lines)
    assert wrong not in output and right not in output and "Pa55word" not in output
