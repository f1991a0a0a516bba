"""Shared fixtures: a tiny real model on disk, a real Redis, unique key prefixes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CI has 2 cores and tests run worker subprocesses beside pytest: one intra-op thread
# each avoids OpenMP oversubscription (busy-waiting threads slow everything 10x).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402

from tests.tiny_model import build_tiny_bert, build_tiny_model  # noqa: E402
from tests.worker_proc import make_env  # noqa: E402
from worker.redis_server import INSTALL_HINT, PrivateRedis, RedisRefused, answers, find_server_binary  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REDIS_URL = os.environ.get("TRIAGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random-weight Qwen2 model + trained BPE tokenizer with a chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer random-weight BERT encoder + WordPiece tokenizer (sentence-transformers layout)."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def redis_url(request) -> Iterator[str]:
    """TRIAGE_TEST_REDIS_URL (default 127.0.0.1:6379) if a Redis answers there; else a private server for the
    session on a free port (redis-server from PATH or the embedded-redis extra); else the Redis tests skip."""
    try:
        shared = answers(REDIS_URL)
    except RedisRefused:  # e.g. a password-protected Redis at the default URL: the tests bring their own
        shared = False
    if shared:
        yield REDIS_URL
        return
    binary = find_server_binary()
    if binary is None:
        pytest.skip(f"no Redis at {REDIS_URL} and no redis-server to start: {INSTALL_HINT}")
    with PrivateRedis(binary=binary) as server:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                note = f"no Redis at {REDIS_URL}: tests use a private {binary.describe()} at {server.url}"
                reporter.write_line("\n" + note)
        yield server.url


@pytest.fixture
def key_prefix(redis_url) -> str:
    """A unique key prefix; every key a test creates under it is deleted afterwards (and nothing else)."""
    prefix = f"triage-test:{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def triage_env(tiny_model_dir, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    """Environment for a worker/producer subprocess: tiny model, test-owned streams and keys."""
    return make_env(tiny_model_dir, redis_url, key_prefix, tmp_path / "cache")
