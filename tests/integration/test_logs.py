"""Logs: every line on the JSON path is one JSON object, each record once, whoever logged it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.worker_proc import REPO, env_with, start_worker


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line[:300]!r}") from None
        assert isinstance(rec, dict), line
        out.append(rec)
    return out


EMIT = """
import logging, warnings
import transformers  # imports huggingface_hub, which adds its own stderr handler
from worker.logs import configure_logging
configure_logging("json", "INFO")
logging.getLogger("huggingface_hub.file_download").warning("hub says hello")
logging.getLogger("transformers.modeling_utils").warning("transformers says hello")
logging.getLogger("rq.worker").info("rq says hello")
logging.getLogger("redis.connection").warning("redis says hello")
warnings.warn("a deprecation from somewhere", UserWarning)
"""


def test_library_records_and_warnings_come_out_once_as_json():
    r = subprocess.run(
        [sys.executable, "-c", EMIT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    recs = _json_lines(r.stderr)
    events = [rec["event"] for rec in recs]
    for said in ("hub says hello", "transformers says hello", "rq says hello", "redis says hello"):
        assert events.count(said) == 1, events
    assert any("a deprecation from somewhere" in e and rec["logger"] == "py.warnings" for e, rec in zip(events, recs))
    assert r.stdout == ""


@pytest.mark.real_model
def test_first_start_on_the_bundled_model_logs_only_json(triage_env, tmp_path):
    """Empty cache: the first start converts the GGUF (a tqdm bar used to land on stderr)."""
    env = env_with(
        triage_env, TRIAGE_MODEL="bundled:smollm2", TRIAGE_CACHE_DIR=tmp_path / "empty-cache", TRIAGE_DTYPE="fp32"
    )
    w = start_worker(env, "run", "--drain", ready=False, spawn="exec")  # all of stderr, from interpreter start
    assert w.wait(timeout_s=600) == 0, w.stderr_tail()
    recs = _json_lines("\n".join(w.lines))
    events = [r.get("event", "") for r in recs]
    assert any(e.startswith("converting GGUF once") for e in events), events  # it really was a first start
    assert "worker_stopped" in events and w.stdout_lines == []


def test_every_line_of_a_worker_names_its_consumer(triage_env):
    """Library and engine records too (``triage.assemble``'s scorer line had none): ops filter a pod's lines by it."""
    env = env_with(triage_env, TRIAGE_CONSUMER="logs-a", TRIAGE_LOG_FORMAT="json")
    w = start_worker(env, "run", "--drain", ready=False, spawn="exec")  # all of stderr, from interpreter start
    assert w.wait(timeout_s=300) == 0, w.stderr_tail()
    recs = _json_lines("\n".join(w.lines))
    assert {r["logger"] for r in recs} - {"triage.worker"}, "test needs lines of other loggers"
    assert [r for r in recs if r.get("consumer") != "logs-a"] == []
    # the scorer's line is an event name with fields (it was a sentence as its event: ops cannot select it)
    (scorer,) = [r for r in recs if r["event"] == "scorer_selected"]
    assert scorer["logger"] == "triage.assemble" and scorer["scorer"] in ("head", "prompt"), scorer
