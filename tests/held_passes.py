"""Imported into a worker process before it starts (``TRIAGE_TEST_PRELOAD=tests.held_passes``: tests.zygote and
tests.run_worker): every forward pass of the real engine once the model has started (not the start-up's own passes:
warm-up, a head fitted on the task's examples) is held before it runs, as a long pass on a slow device would be,
whatever this CPU's speed:

* ``TRIAGE_TEST_PASS_HOLD_S``: for that many seconds;
* ``TRIAGE_TEST_PASS_HOLD_UNTIL``: until that Redis key exists (at most ten minutes);
* ``TRIAGE_TEST_PASS_MARK``: a Redis key set (to the pass's ticket count) once a pass is held.

So a test's premise (a pass longer than the heartbeat TTL, a stop that lands mid-pass) holds by construction,
not by the box being slow enough; the pass itself then runs unchanged, as ``HeldPassBatchWorker`` does for RQ."""

from __future__ import annotations

import os
import time

import redis

from worker import model_start
from worker.engine.classifier import Classifier

_scores, _start_model = Classifier._scores, model_start.start_model
_started = False


def _held_scores(self, items, *args, **kwargs):
    """Inside the pass's own clock (``launch_pass``'s timer): its ``infer_ms`` counts the hold, as a slow device's."""
    if _started:
        _hold(len(items))
    return _scores(self, items, *args, **kwargs)


def _start_then_hold(*args, **kwargs):
    global _started
    out = _start_model(*args, **kwargs)
    _started = True
    return out


def _hold(n: int) -> None:
    env = os.environ
    client = (
        redis.Redis.from_url(env["TRIAGE_REDIS_URL"])
        if "TRIAGE_TEST_PASS_MARK" in env or "TRIAGE_TEST_PASS_HOLD_UNTIL" in env
        else None
    )
    if "TRIAGE_TEST_PASS_MARK" in env:
        client.set(env["TRIAGE_TEST_PASS_MARK"], n, ex=600)
    if "TRIAGE_TEST_PASS_HOLD_S" in env:
        time.sleep(float(env["TRIAGE_TEST_PASS_HOLD_S"]))
    if "TRIAGE_TEST_PASS_HOLD_UNTIL" in env:
        deadline = time.monotonic() + 600
        while not client.exists(env["TRIAGE_TEST_PASS_HOLD_UNTIL"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    if client is not None:
        client.close()


Classifier._scores = _held_scores
model_start.start_model = _start_then_hold
