"""Imported into a worker process before it starts (``TRIAGE_TEST_PRELOAD=tests.held_passes``: tests.zygote and
tests.run_worker): every forward pass of the real engine once the model has started (not the start-up's own passes:
warm-up, a head fitted on the task's examples) is held before it runs, as a long pass on a slow device would be,
whatever this CPU's speed (``tests.holds.hold``):

* ``TRIAGE_TEST_PASS_HOLD_S``: for that many seconds;
* ``TRIAGE_TEST_PASS_HOLD_UNTIL``: until that Redis key exists (at most ten minutes);
* ``TRIAGE_TEST_PASS_MARK``: a Redis key set (to the pass's ticket count) once a pass is held.

So a test's premise (a pass longer than the heartbeat TTL, a stop that lands mid-pass) holds by construction,
not by the box being slow enough; the pass itself then runs unchanged, as ``HeldPassBatchWorker`` does for RQ."""

from __future__ import annotations

import os

import redis

from tests.holds import hold
from worker import model_start
from worker.engine.classifier import Classifier

_scores, _start_model = Classifier._scores, model_start.start_model
_started = False
_holding = False  # a pass's scores computed ticket by ticket call _scores again: held once


def _held_scores(self, items, *args, **kwargs):
    """Inside the pass's own clock (``launch_pass``'s timer): its ``infer_ms`` counts the hold, as a slow device's."""
    global _holding
    if not _started or _holding:
        return _scores(self, items, *args, **kwargs)
    _holding = True
    try:
        _hold(len(items))
        return _scores(self, items, *args, **kwargs)
    finally:
        _holding = False


def _hold(n: int) -> None:
    env = os.environ
    client = redis.Redis.from_url(env["TRIAGE_REDIS_URL"])
    try:
        seconds = float(env["TRIAGE_TEST_PASS_HOLD_S"]) if "TRIAGE_TEST_PASS_HOLD_S" in env else None
        hold(
            client,
            mark_key=env.get("TRIAGE_TEST_PASS_MARK"),
            mark_value=n,
            until_key=env.get("TRIAGE_TEST_PASS_HOLD_UNTIL"),
            seconds=seconds,
        )
    finally:
        client.close()


def _start_then_hold(*args, **kwargs):
    global _started
    out = _start_model(*args, **kwargs)
    _started = True
    return out


Classifier._scores = _held_scores
model_start.start_model = _start_then_hold
