"""A Redis on a Unix socket (``unix:///path?db=0``, a form the docs and ``check`` name): the stream worker did not
start on one (redis-py's Unix connection takes no ``socket_keepalive``), after ``check`` had passed the URL."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from producer import ProducerSettings, TriageClient
from tests.worker_proc import env_with, run_cli, start_worker
from worker.redis_server import PrivateRedis, find_server_binary


@pytest.fixture(scope="module")
def socket_url():
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server to start")
    # a short path: a Unix socket's path is capped at ~107 bytes, and pytest's tmp paths can be longer
    with tempfile.TemporaryDirectory(prefix="triage-sock-") as d:
        sock = Path(d) / "redis.sock"
        with PrivateRedis(binary=binary, extra_config=[f"unixsocket {sock}", "unixsocketperm 700"]):
            yield f"unix://{sock}?db=0"


def test_the_stream_worker_and_the_client_work_over_a_unix_socket(triage_env, socket_url):
    env = env_with(triage_env, TRIAGE_REDIS_URL=socket_url)
    checked = run_cli(env, "check")
    assert checked.returncode == 0, checked.stderr
    client = TriageClient(
        ProducerSettings(
            redis_url=socket_url,
            input_stream=env["TRIAGE_INPUT_STREAM"],
            results_stream=env["TRIAGE_RESULTS_STREAM"],
            dead_letter_stream=env["TRIAGE_DEAD_LETTER_STREAM"],
            result_key_prefix=env["TRIAGE_RESULT_KEY_PREFIX"],
        )
    )
    sent = client.submit_many([{"id": "U-1", "text": "I was charged twice"}, {"id": "U-2", "text": " "}])
    with start_worker(env, "run", "--drain", ready=False) as w:
        assert w.wait(timeout_s=120) == 0, w.stderr_tail()
    got = client.wait(sent, timeout_s=5)
    assert got["U-1"].ok and got["U-2"].status == "dead_letter"
    assert client.backlog() == 0
