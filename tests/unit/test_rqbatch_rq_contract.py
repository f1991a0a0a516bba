"""The batch worker against the installed RQ, without Redis: the private RQ names it relies on, the fill wait it uses,
the plain path's argument check.

worker/rqbatch calls RQ's underscore names (RQ 3.0's own handle_job_* steps, its worker's flags): an RQ 3.x that
renames one must fail here, loudly, not as an AttributeError in the middle of a batch.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace

import pytest
import redis
from rq.job import Job
from rq.worker import BaseWorker

from worker.rqbatch import BatchWorker, intake, plain
from worker.rqbatch.payload import InvalidJob

NO_REDIS = redis.Redis(port=1)  # never reached: nothing here connects


def _worker() -> BatchWorker:
    return BatchWorker(["q"], connection=NO_REDIS, name="contract", prepare_for_work=False)


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_the_private_rq_names_the_batch_worker_uses_exist_in_the_installed_rq():
    job = Job(connection=NO_REDIS)
    for attr in ("_result", "_status", "_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
        assert hasattr(job, attr), f"rq.job.Job has no {attr}"
    handled = {"pipeline", "worker_name", "execution_id", "execution_started_at", "execution_ended_at"}
    assert handled <= _params(Job._handle_failure) and "exc_string" in _params(Job._handle_failure)
    assert handled <= _params(Job._handle_success) and "result_ttl" in _params(Job._handle_success)
    assert _params(BaseWorker._enqueue_dependents_safely) >= {"queue", "job"}
    assert _params(BaseWorker._release_slot_safely) >= {"job"}
    worker = _worker()
    for attr in ("_exc_handlers", "_ordered_queues", "_stop_requested", "_stopped_job_id"):
        assert hasattr(worker, attr), f"RQ's worker has no {attr}"
    for attr in ("pubsub_thread", "pubsub_channel_name"):  # BatchWorker.unsubscribe replaces RQ's
        assert hasattr(worker, attr), f"RQ's worker has no {attr}"
    thread = redis.client.PubSubWorkerThread(NO_REDIS.pubsub(), sleep_time=1)
    assert isinstance(thread._running, threading.Event)  # the loop flag BatchWorker.unsubscribe clears
    # BatchWorker.cleanup_execution puts its token into RQ's own success transaction: RQ must call it there.
    assert "self.cleanup_execution(" in inspect.getsource(BaseWorker.handle_job_success)


def test_a_batch_waits_for_the_capped_fill_wait_not_the_setting(monkeypatch):
    """The cap tested as a function (test_rq_faults) must also be what execute_job hands the fill."""
    worker = _worker()
    worker.settings = SimpleNamespace(max_wait_ms=120_000)
    waits: list[float] = []
    monkeypatch.setattr(intake, "fill", lambda w, batch, limit, max_wait_s: waits.append(max_wait_s))
    monkeypatch.setattr(worker, "batch_max_items", lambda: 4)
    monkeypatch.setattr(worker, "run_batch", lambda entries, fill_ms=0.0: None)
    monkeypatch.setattr(worker, "set_state", lambda state, pipeline=None: None)
    worker.execute_job(Job(connection=NO_REDIS), worker.queues[0])
    assert waits == [intake.FILL_WAIT_MAX_S]


def test_the_plain_path_refuses_bad_arguments_before_loading_the_model(monkeypatch):
    """``classify(tikcet=...)`` on a plain ``rq worker`` loaded the model (minutes on a cold GPU) to fail."""

    def no_model():
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(plain, "engine", no_model)
    for args, kwargs in [((), {"tikcet": "hello"}), (("a", "b"), {}), ((), {})]:
        with pytest.raises(InvalidJob):
            plain.classify_one(args, kwargs)


def test_the_start_finds_a_registration_whose_reply_was_lost_by_the_birth_date_rq_writes():
    """``RedisWaits._birth_landed`` knows its own registration by the birth date RQ's register_birth sets on the worker
    before its transaction and writes as ``birth``: an RQ that sets it later, or names it otherwise, must fail here."""
    from rq.utils import now, utcformat

    source = inspect.getsource(BaseWorker.register_birth)
    assert source.index("self.birth_date =") < source.index(".execute()")
    worker = _worker()
    worker.birth_date = worker.last_heartbeat = now()
    assert worker.serialize()["birth"] == utcformat(worker.birth_date)
