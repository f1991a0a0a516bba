"""``rq suspend`` and the RQ batch worker: honoured between batches, and it stops a batch that is filling. Real Redis,
a real ``rq worker`` process, the tiny model.

RQ's suspension key (``rq:suspended``, ``rq.suspension.WORKERS_SUSPENDED``) is one per Redis, not per queue: set on the
shared test Redis it would suspend every other test's RQ worker (pytest-xdist runs test files in parallel against
it). This test runs its worker on a private redis-server, and resumes in a ``finally``.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.suspension import WORKERS_SUSPENDED, resume, suspend

from producer.rq_client import enqueue_tickets
from tests.integration import test_rq
from tests.integration.test_rq import TICKETS, _assert_labelled, _log_events, _running, _wait_for
from tests.integration.test_rq_faults import _in_process
from worker.redis_server import PrivateRedis, find_server_binary
from worker.rqbatch import intake

JOBS = 20
rq_setup = test_rq.rq_setup  # the fixture: a test-owned queue and worker name on the shared Redis, removed after


@contextmanager
def _private(key_prefix: str, triage_env: dict[str, str], tmp_path):
    """The harness ``_running`` takes, on a private redis-server (names still under the test's ``key_prefix``)."""
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server to start privately")
    with PrivateRedis(binary=binary) as server:
        conn = redis.Redis.from_url(server.url)
        yield SimpleNamespace(
            conn=conn,
            url=server.url,
            queue=Queue(key_prefix + "q", connection=conn, serializer=JSONSerializer),
            worker_name=(key_prefix + "w").replace(":", "-"),
            env={**triage_env, "TRIAGE_REDIS_URL": server.url},
            log=tmp_path / "worker.log",
        )


def _state(h) -> str | None:
    raw = h.conn.hget(f"rq:worker:{h.worker_name}", "state")
    return raw.decode() if raw is not None else None


def _statuses(h, jobs) -> list[JobStatus]:
    return [Job.fetch(j.id, connection=h.conn, serializer=JSONSerializer).get_status() for j in jobs]


def _taken(h, jobs) -> list[JobStatus]:
    """The statuses of ``jobs`` no longer queued (started, finished or failed: taken by a worker)."""
    return [s for s in _statuses(h, jobs) if s != JobStatus.QUEUED]


def test_rq_suspend_stops_a_filling_batch_and_resume_runs_the_rest(key_prefix, triage_env, tmp_path):
    """RQ checks ``rq suspend`` at the top of its work loop, before each job it dequeues; the batch worker then took up
    to N-1 more queued jobs without looking: a worker idle (blocked in RQ's dequeue) when ``rq suspend`` ran took the
    whole backlog that arrived after it (20 of 20; RQ's SimpleWorker starts at most the one it was dequeuing). The fill
    now stops once the worker is suspended: the batch in hand (that one job) runs, the rest wait for ``rq resume``."""
    with _private(key_prefix, triage_env, tmp_path) as h:
        # A long fill wait: a fill that does not look at the suspension takes every job that arrives in it.
        with _running(h, TRIAGE_MAX_WAIT_MS="2000") as proc:
            try:
                # "idle" is set inside RQ's dequeue, after its suspension check: the worker no longer looks before
                # it takes the next job (RQ's own race; at most that one job).
                _wait_for(lambda: _state(h) == "idle", "the worker's dequeue", proc, h)
                suspend(h.conn)
                assert h.conn.exists(WORKERS_SUSPENDED)
                jobs = enqueue_tickets(h.queue, [f"{TICKETS[i % len(TICKETS)]} #{i}" for i in range(JOBS)])
                _wait_for(lambda: _state(h) == "suspended", "the worker to be suspended", proc, h)
                taken = _taken(h, jobs)
                assert len(taken) <= 1, f"{len(taken)} of {JOBS} jobs enqueued after `rq suspend` were taken"
                assert h.queue.count == JOBS - len(taken)
                stops = _log_events(h, "rq_fill_suspended")
                assert [e["batch"] for e in stops] == [1] * len(taken), stops
                resume(h.conn)
                finished = lambda: _statuses(h, jobs).count(JobStatus.FINISHED) == JOBS  # noqa: E731
                _wait_for(finished, "all jobs to finish", proc, h)
                _assert_labelled(h, jobs)
            finally:
                resume(h.conn)  # the server is this test's own, but leave no suspension behind


class _RefusesTheSuspensionCheck(redis.Redis):
    """A connection whose EXISTS of RQ's suspension key raises ``error`` (the test sets it)."""

    error: Exception

    def exists(self, *names):
        if WORKERS_SUSPENDED in names:
            raise self.error
        return super().exists(*names)


@pytest.mark.parametrize(
    ("error", "passes"),
    [(redis.BusyLoadingError("LOADING Redis is loading"), True), (redis.ResponseError("NOPERM exists"), False)],
)
def test_a_refused_suspension_check_is_a_refused_fill(rq_setup, error, passes):
    """The fill's suspension check meets Redis' errors as its moves do: one that passes by itself stops the fill and
    the batch in hand goes on (nothing more taken); any other is raised."""
    conn = _RefusesTheSuspensionCheck.from_url(rq_setup.url)
    conn.error = error
    queue = Queue(rq_setup.queue.name, connection=conn, serializer=JSONSerializer)
    first, *rest = rq_setup.jobs = enqueue_tickets(queue, TICKETS[:3])
    assert conn.lmove(queue.key, queue.intermediate_queue_key).decode() == first.id  # RQ's handover
    batch = [(Job.fetch(first.id, connection=conn, serializer=JSONSerializer), queue)]
    worker = _in_process(conn, [queue.name], rq_setup.worker_name)
    if passes:
        intake.fill(worker, batch, limit=3, max_wait_s=30.0)
    else:
        with pytest.raises(redis.ResponseError, match="NOPERM"):
            intake.fill(worker, batch, limit=3, max_wait_s=30.0)
    assert [j.id for j, _ in batch] == [first.id]
    assert queue.get_job_ids() == [j.id for j in rest]  # not taken: still queued
    conn.lrem(queue.intermediate_queue_key, 0, first.id)
