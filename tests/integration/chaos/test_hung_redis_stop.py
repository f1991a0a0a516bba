"""A warm stop while Redis has stopped answering (a paused host, a partition: no refusal, no reply).

The read in progress ends at its socket timeout; the exit's two Redis calls (leave the group, release the heartbeat)
then ran on the worker's own client, 15 s or more each, so an idle worker took 45 s to exit 0, past compose's grace
(a shutdown hunt). They now run on a client of their own with a short timeout.
"""

from __future__ import annotations

import os
import signal

from tests.integration.chaos.conftest import worker_env
from worker.stream.startup import EXIT_STEP_TIMEOUT_S


def test_a_warm_stop_against_a_redis_that_stopped_answering_waits_out_the_read_only(
    launch, chaos_redis, tiny_model_dir, tmp_path
):
    env = worker_env(tiny_model_dir, chaos_redis.url, tmp_path)
    w = launch(env, "run")
    os.kill(chaos_redis.pid, signal.SIGSTOP)
    try:
        w.signal(signal.SIGTERM)
        # the read's socket timeout (15 s), then the two exit calls at EXIT_STEP_TIMEOUT_S each, with room for a busy
        # box; before: three socket timeouts (45 s)
        assert w.wait(timeout_s=15 + 2 * EXIT_STEP_TIMEOUT_S + 15) == 0, w.stderr_tail()
    finally:
        os.kill(chaos_redis.pid, signal.SIGCONT)
    failed = w.events("cleanup_failed")
    assert len(failed) == 2 and all("imeout" in e["error"] for e in failed), failed
    assert w.events("warm_shutdown") and w.events("worker_stopped")
