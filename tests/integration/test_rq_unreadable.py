"""Job keys RQ cannot read, met where the older tests (test_rq_faults) do not put them: a started job whose hash turned
unreadable after its worker died, and a job key that is not a hash at all (WRONGTYPE). Each fails visibly, once, and
the worker goes on. Real Redis, real ``rq worker`` processes, the tiny model."""

from __future__ import annotations

import pytest
from rq.job import JobStatus
from rq.results import Result

from producer.rq_client import enqueue_tickets
from tests.integration import test_rq
from tests.integration.test_rq import TICKETS, _assert_labelled, _log_events, _run_to_exit
from tests.integration.test_rq_faults import (
    BAD_TIMEOUT,
    _bad_among_good,
    _corrupt,
    _fetch,
    _in_process,
    _private_server,
    _started,
    _two_workers_fail_listed,
)
from worker.rqbatch import unreadable

rq_setup = test_rq.rq_setup


def _not_a_hash(h, job) -> None:
    """The job's key replaced by a string (another program writing under RQ's names): HGETALL answers WRONGTYPE."""
    h.conn.delete(job.key)
    h.conn.set(job.key, "not a job")


def _assert_failed_not_a_hash(h, job, queue) -> None:
    """Failed, in its queue's FailedJobRegistry, with one failed Result that says why; its key left as it was."""
    assert job.id in queue.failed_job_registry.get_job_ids()
    (result,) = Result.all(job)
    assert result.type == Result.Type.FAILED
    assert "is a string, not a hash" in result.exc_string, result.exc_string
    assert h.conn.get(job.key) == b"not a job"
    assert h.conn.llen(queue.intermediate_queue_key) == 0


def _abandoned(h, job) -> None:
    """``job`` STARTED by a worker that died mid-batch, its execution expired: what RQ's registry cleanup fails."""
    dead = _in_process(h.conn, [h.queue.name], h.worker_name + "-dead")
    _started(dead, [job])
    registry = h.queue.started_job_registry
    h.conn.zadd(registry.key, {m: 1 for m in h.conn.zrange(registry.key, 0, -1)}, xx=True)


@pytest.mark.parametrize("how", ["field", "not-a-hash"])
def test_an_abandoned_job_rq_cannot_read_fails_visibly_and_the_worker_goes_on(rq_setup, how):
    """RQ's registry cleanup (StartedJobRegistry.cleanup, in every worker's maintenance) fetches each abandoned job and
    raised on one it cannot read: every worker start quit ("found an unhandled exception") before taking a job."""
    h, q = rq_setup, rq_setup.queue
    bad = enqueue_tickets(q, ["I was charged twice."])[0]
    good = enqueue_tickets(q, TICKETS[:2])
    h.jobs += [bad, *good]
    _abandoned(h, bad)
    (_corrupt if how == "field" else _not_a_hash)(h, bad)
    _run_to_exit(h)
    _assert_labelled(h, good)
    assert q.started_job_registry.get_job_ids() == [] and q.count == 0
    if how == "field":  # as an unreadable queued job, but it may have run: its worker died with it in hand
        job = _fetch(h, bad)  # it reads again: the field RQ could not read is gone (its value is in the reason)
        (result,) = job.results()
        assert job.get_status() == JobStatus.FAILED and bad.id in q.failed_job_registry.get_job_ids()
        assert f"timeout='{BAD_TIMEOUT}'" in result.exc_string and "abandoned" in result.exc_string, result.exc_string
    else:
        _assert_failed_not_a_hash(h, bad, q)
    (line,) = _log_events(h, "rq_job_unreadable")
    assert line["job_id"] == bad.id and line["abandoned"] is True
    assert "unhandled exception" not in h.log.read_text()


@pytest.mark.parametrize(
    "where, queues",
    [("taken by the fill", 1), ("handed over by RQ", 1), ("handed over by RQ", 2), ("left listed", 1)],
    ids=["fill", "first-one-queue", "first-two-queues", "intermediate-list"],
)
def test_a_job_key_that_is_not_a_hash_fails_visibly_and_the_worker_goes_on(rq_setup, where, queues):
    """HGETALL answers WRONGTYPE: RQ's dequeue raised it (the work loop quit), so did the fill's read of the batch's
    hashes (the batch and the worker ended) and the failure of unreadable jobs in the intermediate list, at every
    maintenance run (every worker start quit). The key is left as it is: it is not RQ's to rewrite."""
    h, q = rq_setup, rq_setup.queue
    q2, before, bad, after = _bad_among_good(h, where, _not_a_hash)
    if where == "left listed":  # as a worker killed mid-fill leaves it
        assert h.conn.lmove(q.key, q.intermediate_queue_key).decode() == bad.id
    try:
        _run_to_exit(h, *([q2.name] if queues == 2 else []))
        _assert_labelled(h, before + after)
        _assert_failed_not_a_hash(h, bad, q)
        assert q.count == 0 and q.started_job_registry.get_job_ids() == []
        (line,) = _log_events(h, "rq_job_unreadable")
        assert line["job_id"] == bad.id and line["key_type"] == "string"
        assert "unhandled exception" not in h.log.read_text()
    finally:
        q2.delete(delete_jobs=True)


def test_two_workers_failing_the_same_job_key_that_is_not_a_hash_save_one_failure(rq_setup):
    """Its failure cannot mark the job's key (not a hash): it is saved only while the job is still in the list where
    the worker met it, and takes it out of there, so a second worker meeting it finds it gone."""
    with _private_server(rq_setup) as h:
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
        _not_a_hash(h, job)
        _two_workers_fail_listed(h, job)
        _assert_failed_not_a_hash(h, job, h.queue)  # one failed Result


def test_a_job_key_that_is_not_a_hash_failed_by_another_worker_first_is_done_with(rq_setup):
    """The second worker to meet it (its dequeue: RQ raised WRONGTYPE) found it gone from where it met it: that was
    answered "it reads", so the dequeue raised RQ's error again and the worker's loop quit."""
    with _private_server(rq_setup) as h:
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
        _not_a_hash(h, job)
        assert h.conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id
        first, second = (_in_process(h.conn, [h.queue.name], f"{h.worker_name}-{i}") for i in range(2))
        assert unreadable.fail_if_unreadable(first, job.id, first.queues[0], listed=True)
        assert unreadable.fail_if_unreadable(second, job.id, second.queues[0], listed=True)
        _assert_failed_not_a_hash(h, job, h.queue)  # one failed Result


def test_an_ended_job_left_in_the_started_registry_is_not_failed_for_being_unreadable(rq_setup):
    """A finished job whose hash turned unreadable, its started-registry entry left behind: RQ's cleanup skips such
    leftovers (it only fails STARTED jobs) but fetched it first and raised. The entry is removed; the job stays
    finished."""
    h, q = rq_setup, rq_setup.queue
    job = enqueue_tickets(q, TICKETS[:1])[0]
    h.jobs.append(job)
    _abandoned(h, job)
    job = _fetch(h, job)
    job.set_status(JobStatus.FINISHED)
    _corrupt(h, job)
    unreadable.fail_abandoned(_in_process(h.conn, [q.name], h.worker_name), q)
    q.started_job_registry.cleanup()  # RQ's: raised on it
    assert q.started_job_registry.get_job_ids() == [] and q.failed_job_registry.get_job_ids() == []
    assert h.conn.hget(job.key, "status") == b"finished"


@pytest.mark.parametrize("how", ["field", "not-a-hash"])
def test_an_unreadable_job_counts_as_one_failed_request(rq_setup, monkeypatch, how):
    """Failed into the FailedJobRegistry, but in no metric: ``triage_request_failure_total`` missed what ``rq info``
    showed (7 failed jobs against 6 a metrics hunt found counted). Counted once, by the worker that saved the
    failure (two meet it: one failure, one count), under its own reason class."""
    from prometheus_client import CollectorRegistry

    from worker.observability import prometheus

    metrics = prometheus.PrometheusMetrics(CollectorRegistry(), windows=False)
    monkeypatch.setattr(prometheus, "_current", metrics)
    with _private_server(rq_setup) as h:
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
        (_corrupt if how == "field" else _not_a_hash)(h, job)
        assert h.conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id
        first, second = (_in_process(h.conn, [h.queue.name], f"{h.worker_name}-{i}") for i in range(2))
        assert unreadable.fail_if_unreadable(first, job.id, first.queues[0], listed=True)
        unreadable.fail_if_unreadable(second, job.id, second.queues[0], listed=True)  # the job reads now, or is gone
    value = metrics.registry.get_sample_value
    assert value("triage_request_count_total") == 1
    assert value("triage_request_success_total") == 0
    assert value("triage_request_failure_total", {"reason": "unreadable_job"}) == 1
