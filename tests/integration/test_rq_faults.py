"""The RQ batch worker under bad input and a Redis that refuses writes: no job is lost, none runs twice, the worker
keeps running. Real Redis (a private server where a test sets maxmemory), real ``rq worker`` processes, the tiny model.
"""

from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis
from rq import Callback, Queue, Retry, SimpleWorker
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.rq_client import enqueue_tickets
from tests.integration import test_rq
from tests.integration.test_rq import LABELS, TICKETS, _assert_labelled, _log_events, _run_to_exit
from worker.rqbatch import BatchWorker, intake, plain
from worker.rqbatch.payload import InvalidJob, ticket_text

HERE = "tests.integration.test_rq_faults"
rq_setup = test_rq.rq_setup  # the fixture: a test-owned queue and worker name on the shared Redis, removed after


def note_failure(job, connection, exc_type, exc_value, tb):
    """An on_failure callback (allowed in the tests that use it): one line per run in a file, not in Redis (a Redis
    that refuses writes would refuse the mark too)."""
    with open(job.meta["mark_file"], "a") as f:
        f.write(f"{exc_type.__name__}\n")


def _out_of_memory_for(conn: redis.Redis, seconds: float) -> None:
    """Redis refuses every write (maxmemory 1, noeviction) from now for ``seconds``."""
    conn.config_set("maxmemory-policy", "noeviction")
    conn.config_set("maxmemory", 1)
    threading.Timer(seconds, lambda: conn.config_set("maxmemory", 0)).start()


class OutOfMemoryBeforeStartBatchWorker(BatchWorker):
    """Redis runs out of memory as the first batch is about to be recorded (refused jobs failed, the others STARTED):
    for 2 s, nothing of the batch written yet."""

    def run_batch(self, entries, fill_ms=0.0):
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_for(self.connection, 2.0)
        return super().run_batch(entries, fill_ms)


class OutOfMemoryAfterAFailedPassBatchWorker(BatchWorker):
    """Every job of every batch fails in the pass (as on a GPU fault); after the first, Redis refuses writes for
    2 s: the failure callbacks run, the failures cannot be saved yet."""

    def _classify(self, entries):
        out = super()._classify(entries)
        for e in entries:
            e.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_for(self.connection, 2.0)
        return out


@contextmanager
def _private_server(rq_setup):
    """``rq_setup``'s harness on a private redis-server (the test sets maxmemory on it)."""
    from worker.redis_server import PrivateRedis, find_server_binary

    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server to start privately")
    with PrivateRedis(binary=binary) as server:
        conn = redis.Redis.from_url(server.url)
        yield SimpleNamespace(
            conn=conn,
            url=server.url,
            queue=Queue("faults-q", connection=conn, serializer=JSONSerializer),
            worker_name="faults-w",
            jobs=[],
            env={**rq_setup.env, "TRIAGE_REDIS_URL": server.url, "TRIAGE_RECONNECT_MAX_S": "0.5"},
            log=rq_setup.log,
        )


def _fetch(h, job) -> Job:
    return Job.fetch(job.id, connection=h.conn, serializer=JSONSerializer)


# ------------------------------------------------------------------------------------------ unreadable job hashes
def _corrupt(h, job) -> None:
    h.conn.hset(job.key, "timeout", "abc")  # RQ's Job.restore raises on it (parse_timeout)


def _assert_failed_unreadable(h, job, queue) -> None:
    """Failed, in its queue's FailedJobRegistry, with a reason naming the field; readable by RQ again; never run."""
    assert job.id in queue.failed_job_registry.get_job_ids()
    job = _fetch(h, job)  # it reads again: the field RQ could not read is gone (its value is in the reason)
    assert job.get_status() == JobStatus.FAILED and job.started_at is None
    reason = job.latest_result().exc_string
    assert job.latest_result().type == Result.Type.FAILED
    assert "timeout='abc'" in reason and "never ran" in reason, reason
    assert h.conn.llen(queue.intermediate_queue_key) == 0


@pytest.mark.parametrize(
    "where, queues",
    [("taken by the fill", 1), ("handed over by RQ", 1), ("handed over by RQ", 2)],
    ids=["fill", "first-one-queue", "first-two-queues"],
)
def test_a_job_rq_cannot_read_fails_visibly_and_the_worker_goes_on(rq_setup, where, queues):
    """Skipped by the fill, such a job was in no registry (lost). Handed over first, RQ's dequeue raised: its work loop
    quit ("found an unhandled exception") with the job in the intermediate list (one queue) or nowhere (several)."""
    h, q = rq_setup, rq_setup.queue
    q2 = Queue(q.name + "-2", connection=h.conn, serializer=JSONSerializer)  # served first, empty
    before = enqueue_tickets(q, TICKETS[:1]) if where == "taken by the fill" else []
    bad = enqueue_tickets(q, ["I was charged twice."])[0]
    after = enqueue_tickets(q, TICKETS[1:3])
    h.jobs += [*before, bad, *after]
    _corrupt(h, bad)
    try:
        _run_to_exit(h, *([q2.name] if queues == 2 else []))
        _assert_labelled(h, before + after)
        _assert_failed_unreadable(h, bad, q)
        assert q.count == 0 and q.started_job_registry.get_job_ids() == []
        (line,) = _log_events(h, "rq_job_unreadable")
        assert line["job_id"] == bad.id and line["fields"] == ["timeout"] and "abc" not in str(line)
        assert "unhandled exception" not in h.log.read_text()
    finally:
        q2.delete(delete_jobs=True)


def test_rqs_intermediate_queue_cleanup_meets_a_job_it_cannot_read_and_the_worker_goes_on(rq_setup):
    """A job RQ cannot read left in the intermediate list (a worker killed mid-fill, or by RQ's own dequeue): RQ's
    cleanup (``IntermediateQueue.cleanup``, at every maintenance run) raised on it, so every worker start quit."""
    h, q = rq_setup, rq_setup.queue
    bad = enqueue_tickets(q, ["Where is my package?"])[0]
    good = enqueue_tickets(q, TICKETS[:2])
    h.jobs += [bad, *good]
    _corrupt(h, bad)
    assert h.conn.lmove(q.key, q.intermediate_queue_key).decode() == bad.id  # as a worker's dequeue leaves it
    _run_to_exit(h)
    _assert_labelled(h, good)
    _assert_failed_unreadable(h, bad, q)
    assert "unhandled exception" not in h.log.read_text()


# ---------------------------------------------------------------------------------- Redis refusing writes
@pytest.mark.parametrize("with_refused", [False, True], ids=["start", "refused-and-start"])
def test_redis_refusing_writes_before_a_batch_starts_is_waited_out_and_the_jobs_run(rq_setup, with_refused):
    """The refused start escaped: RQ quit the worker with the batch in the intermediate list, and RQ's cleanup later
    failed it as "stuck in intermediate queue". A refused job's failure was dropped (RQ's handle_job_failure logs
    a refused write) and the job taken out of the list: in no queue or registry."""
    with _private_server(rq_setup) as h:
        good = enqueue_tickets(h.queue, TICKETS[:3])
        refused = [h.queue.enqueue("worker.rq_jobs.classify", {"txt": "typo"})] if with_refused else []
        _run_to_exit(h, worker_class=f"{HERE}.OutOfMemoryBeforeStartBatchWorker")
        _assert_labelled(h, good)
        for job in refused:
            job = _fetch(h, job)
            assert job.get_status() == JobStatus.FAILED and job.id in h.queue.failed_job_registry.get_job_ids()
            assert "ticket has no 'text' field" in job.latest_result().exc_string
        assert h.conn.llen(h.queue.intermediate_queue_key) == 0 and h.queue.count == 0
        waits = _log_events(h, "redis_unavailable")
        assert waits and waits[0]["op"] == ("rq_fail" if with_refused else "rq_start"), waits
        assert "OutOfMemory" in waits[0]["error"] or "OOM" in waits[0]["error"], waits
        assert [b["jobs"] for b in _log_events(h, "rq_batch")] == [3 + len(refused)]


def test_a_failure_callback_runs_once_when_redis_refuses_to_save_the_failure(rq_setup, tmp_path):
    """RQ's handle_job_failure logs a refused write and goes on: the job stayed STARTED, and once its execution
    expired RQ's registry cleanup found it abandoned and ran its failure callback a second time. Each failure is now
    saved before the batch moves on; a Retry is counted down once for it (the count is kept in memory until EXEC)."""
    with _private_server(rq_setup) as h:
        once, retried = tmp_path / "once", tmp_path / "retried"
        cb = Callback(f"{HERE}.note_failure")
        plain_job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0], on_failure=cb, meta={"mark_file": str(once)})
        with_retry = h.queue.enqueue(
            "worker.rq_jobs.classify", TICKETS[1], on_failure=cb, meta={"mark_file": str(retried)}, retry=Retry(max=1)
        )
        allowed = {"TRIAGE_RQ_ALLOWED_CALLBACKS": f"{HERE}.note_failure"}
        _run_to_exit(h, worker_class=f"{HERE}.OutOfMemoryAfterAFailedPassBatchWorker", **allowed)
        # As if every execution's heartbeat had run out: RQ's cleanup runs the callback of any job still STARTED.
        registry = h.queue.started_job_registry
        members = h.conn.zrange(registry.key, 0, -1)
        if members:
            h.conn.zadd(registry.key, {m: 1 for m in members}, xx=True)
        registry.cleanup()
        assert once.read_text().splitlines() == ["RuntimeError"]
        assert retried.read_text().splitlines() == ["RuntimeError", "RuntimeError"]  # two runs: the retry's too
        for job in (plain_job, with_retry):
            job = _fetch(h, job)
            assert job.get_status() == JobStatus.FAILED and job.id in h.queue.failed_job_registry.get_job_ids()
            assert "illegal memory access" in job.latest_result().exc_string
        assert _fetch(h, with_retry).retries_left == 0
        assert [b["jobs"] for b in _log_events(h, "rq_batch")] == [2, 1]
        assert [e for e in _log_events(h, "redis_unavailable") if e.get("op") == "rq_fail"], h.log.read_text()


# ------------------------------------------------------------------------------------ the ticket as a keyword
def test_the_ticket_is_one_positional_argument_or_the_keyword_ticket():
    assert ticket_text(({"text": "hello"},), {}, 100) == "hello"
    assert ticket_text((), {"ticket": {"text": "hello"}}, 100) == "hello"
    assert ticket_text((), {"ticket": "hello"}, 100) == "hello"
    refused = [
        ((), {"tikcet": "hello"}, "unexpected keyword argument(s): tikcet"),
        (("hello",), {"ticket": "hello"}, "exactly one ticket argument, got 2"),
        ((), {"ticket": "hello", "lang": "en"}, "unexpected keyword argument(s): lang"),
        ((), {}, "exactly one ticket argument, got 0"),
    ]
    for args, kwargs, reason in refused:
        with pytest.raises(InvalidJob, match=re.escape(reason)):
            ticket_text(args, kwargs, 100)


def _keyword_jobs(q):
    return [
        q.enqueue("worker.rq_jobs.classify", ticket={"text": TICKETS[0]}),
        q.enqueue("worker.rq_jobs.classify", tikcet={"text": TICKETS[1]}),
        q.enqueue("worker.rq_jobs.classify", {"text": TICKETS[2]}, ticket={"text": TICKETS[2]}),
    ]


def test_the_ticket_keyword_runs_alike_on_the_batch_worker_and_a_plain_rq_worker(rq_setup, monkeypatch):
    """The batch worker refused ``ticket=`` that a plain ``rq worker`` ran: both now take it, and refuse other
    keywords with the same reason."""
    h, q = rq_setup, rq_setup.queue
    batch = _keyword_jobs(q)
    h.jobs += batch
    _run_to_exit(h)
    for k, v in h.env.items():
        if k.startswith("TRIAGE_"):
            monkeypatch.setenv(k, v)
    one_by_one = _keyword_jobs(q)
    h.jobs += one_by_one
    plain.engine.cache_clear()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        SimpleWorker([q], connection=h.conn, serializer=JSONSerializer, name=h.worker_name).work(burst=True)
    finally:
        plain.engine.cache_clear()
        for s, handler in handlers.items():
            signal.signal(s, handler)
    for jobs in (batch, one_by_one):
        done = [_fetch(h, j) for j in jobs]
        assert [j.get_status() for j in done] == [JobStatus.FINISHED, JobStatus.FAILED, JobStatus.FAILED]
        assert done[0].return_value()["label"] in LABELS
    reasons = [[_fetch(h, j).latest_result().exc_string.splitlines()[-1] for j in js[1:]] for js in (batch, one_by_one)]
    assert reasons[0] == reasons[1], reasons
    assert "unexpected keyword argument(s): tikcet" in reasons[0][0] and "got 2" in reasons[0][1]


# --------------------------------------------------------------------------------------- the fill wait's cap
def test_the_fill_wait_stays_well_inside_rqs_intermediate_queue_threshold(redis_url, key_prefix):
    """RQ's cleanup fails a job it finds in an intermediate list twice, over a minute apart: a batch holding its jobs
    there for TRIAGE_MAX_WAIT_MS >= 60 s could have one failed under it by another worker's maintenance."""
    from datetime import timedelta

    from rq.intermediate_queue import IntermediateQueue
    from rq.utils import now

    assert intake.fill_wait_s(50) == 0.05 and intake.fill_wait_s(30_000) == 30.0
    assert intake.fill_wait_s(120_000) == intake.FILL_WAIT_MAX_S == 30.0
    listed = IntermediateQueue(key_prefix + "q", connection=redis.Redis.from_url(redis_url))

    def cleaned_up_after(held_s: float) -> bool:  # RQ's own rule, on a first sighting ``held_s`` ago
        listed.connection.set(listed.get_first_seen_key("j"), (now() - timedelta(seconds=held_s)).timestamp(), ex=60)
        return listed.should_be_cleaned_up("j")

    assert cleaned_up_after(61) and not cleaned_up_after(2 * intake.FILL_WAIT_MAX_S - 5)  # the cap leaves ~30 s
