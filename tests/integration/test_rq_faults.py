"""The RQ batch worker under bad input and a Redis that refuses writes: no job is lost, none runs twice, the worker
keeps running. Real Redis (a private server where a test sets maxmemory), real ``rq worker`` processes, the tiny model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import redis
from rq import Callback, Queue, Repeat, Retry, SimpleWorker
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.webhook import Webhook

from producer.rq_client import enqueue_tickets
from tests.integration import test_rq
from tests.integration.test_rq import LABELS, TICKETS, _assert_labelled, _log_events, _run_to_exit, _running, _wait_for
from tests.metrics_scrape import scrape
from tests.tcp_proxy import TcpProxy
from worker.engine.types import Prediction
from worker.redis_server import free_port
from worker.rqbatch import BatchWorker, intake, outcome, plain, unreadable, waits
from worker.rqbatch.jobs import Entry
from worker.rqbatch.landing import Landing
from worker.rqbatch.payload import InvalidJob, job_result, ticket_text
from worker.stream.messages import with_subject

HERE = "tests.integration.test_rq_faults"
rq_setup = test_rq.rq_setup  # the fixture: a test-owned queue and worker name on the shared Redis, removed after


def note_failure(job, connection, exc_type, exc_value, tb):
    """An on_failure callback (allowed in the tests that use it): one line per run in a file, not in Redis (a Redis
    that refuses writes would refuse the mark too)."""
    with open(job.meta["mark_file"], "a") as f:
        f.write(f"{exc_type.__name__}\n")


def _out_of_memory(conn: redis.Redis) -> None:
    """Redis refuses every write (maxmemory 1, noeviction) from now until ``maxmemory`` is set back to 0."""
    conn.config_set("maxmemory-policy", "noeviction")
    conn.config_set("maxmemory", 1)


def _out_of_memory_for(conn: redis.Redis, seconds: float) -> None:
    """Redis refuses every write (maxmemory 1, noeviction) from now for ``seconds``."""
    _out_of_memory(conn)
    threading.Timer(seconds, lambda: conn.config_set("maxmemory", 0)).start()


def _out_of_memory_until_refused(conn: redis.Redis, *ops: str, at_most_s: float = 30.0) -> None:
    """Redis refuses every write from now until this worker has had a try of one of ``ops`` refused (its
    ``redis_unavailable`` line logged), then takes them again: the refusal meets that write whatever this box's
    speed (on a 2 s timer, a worker held up as long reached it after the refusal had ended). ``at_most_s``: lifted
    anyway, so a test whose worker never tries ``ops`` fails on its asserts rather than hangs."""
    lifted = threading.Lock()

    def lift() -> None:
        if lifted.acquire(blocking=False):
            conn.config_set("maxmemory", 0)

    real = waits.RedisWait.failed

    def failed(self, e, stop=None):
        try:
            return real(self, e, stop)
        finally:
            if self.op in ops:
                lift()

    waits.RedisWait.failed = failed
    _out_of_memory(conn)
    timer = threading.Timer(at_most_s, lift)
    timer.daemon = True
    timer.start()


class OutOfMemoryBeforeStartBatchWorker(BatchWorker):
    """Redis runs out of memory as the first batch is about to be recorded (refused jobs failed, the others STARTED),
    nothing of the batch written yet, until the batch's start has been refused."""

    def run_batch(self, entries, fill_ms=0.0):
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_until_refused(self.connection, "rq_start")
        return super().run_batch(entries, fill_ms)


class OutOfMemoryAfterAFailedPassBatchWorker(BatchWorker):
    """Every job of every batch fails in the pass (as on a GPU fault); after the first, Redis refuses writes until a
    failure's save has been refused: the failure callbacks run, the failures cannot be saved yet."""

    def _classify(self, entries):
        out = super()._classify(entries)
        for e in entries:
            e.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_until_refused(self.connection, "rq_fail")
        return out


@contextmanager
def _private_server(rq_setup, *extra_config: str):
    """``rq_setup``'s harness on a private redis-server (the test sets maxmemory on it); ``extra_config``: more lines
    of its redis.conf."""
    from worker.redis_server import PrivateRedis, find_server_binary

    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server to start privately")
    with PrivateRedis(binary=binary, extra_config=extra_config) as server:
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


def _in_process(conn: redis.Redis, queues: list[str], name: str, **kw) -> BatchWorker:
    """A batch worker in this process (no model): for the steps that are functions of Redis' state."""
    from worker.logs import get_logger

    worker = BatchWorker(queues, connection=conn, name=name, **kw)
    worker.settings, worker.tlog = SimpleNamespace(reconnect_max_s=0.5), get_logger("triage.rq")
    return worker


def _started(worker: BatchWorker, jobs) -> list[Entry]:
    """``jobs`` (queued, in this order) handed over and STARTED as a batch (``outcome.start``)."""
    queue, conn = worker.queues[0], worker.connection
    for job in jobs:
        assert conn.lmove(queue.key, queue.intermediate_queue_key).decode() == job.id
    entries = [Entry(job=Job.fetch(j.id, connection=conn, serializer=JSONSerializer), queue=queue) for j in jobs]
    outcome.start(worker, entries, 90, Landing(worker))
    return entries


def _classified(entries: list[Entry]) -> None:
    pred = Prediction(label="billing", scores={"billing": 0.9, "other": 0.1}, truncated=False, n_tokens=5)
    for e in entries:
        e.pred, e.result, e.job.ended_at = pred, job_result(pred, "test-model"), now()


def _succeed(worker: BatchWorker, entries: list[Entry], stream: str) -> None:
    landing = Landing(worker)
    worker.until_written(lambda: outcome.succeed(worker, entries, stream, 1000, "test-model", landing))


def _one_job(h, conn: redis.Redis) -> tuple[Job, BatchWorker]:
    """A queued job (the test's, deleted after it) and a batch worker in this process on ``conn``."""
    job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
    h.jobs.append(job)
    return job, _in_process(conn, [h.queue.name], h.worker_name)


@contextmanager
def _lossy(redis_url: str):
    """A connection to the test Redis through a TCP proxy that can drop a connection right after forwarding a
    transaction (it runs, its reply is lost): real replies, a real reset. The record's MULTI is told by a command
    only it sends, HINCRBY (the worker's job counts): RQ reads dependents in MULTIs of their own."""
    kw = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    with TcpProxy(kw.get("host", "127.0.0.1"), kw.get("port", 6379)) as proxy:
        yield proxy, redis.Redis(port=proxy.port, db=kw.get("db", 0), password=kw.get("password"))


# ------------------------------------------------------------------------------------------ unreadable job hashes
BAD_TIMEOUT = "nine-ish"  # not hex: a job id (a UUID) can hold "abc", which a check for its absence then found


def _corrupt(h, job) -> None:
    h.conn.hset(job.key, "timeout", BAD_TIMEOUT)  # RQ's Job.restore raises on it (parse_timeout)


def _bad_among_good(h, where: str, spoil):
    """An empty second queue (served first), and in the first: one good job if ``where`` is the fill, then the job
    ``spoil`` makes unreadable, then two good ones. Returns (second queue, before, bad, after)."""
    q = h.queue
    q2 = Queue(q.name + "-2", connection=h.conn, serializer=JSONSerializer)
    before = enqueue_tickets(q, TICKETS[:1]) if where == "taken by the fill" else []
    bad = enqueue_tickets(q, ["I was charged twice."])[0]
    after = enqueue_tickets(q, TICKETS[1:3])
    h.jobs += [*before, bad, *after]
    spoil(h, bad)
    return q2, before, bad, after


def _assert_failed_unreadable(h, job, queue) -> None:
    """Failed, in its queue's FailedJobRegistry, with a reason naming the field; readable by RQ again; never run."""
    assert job.id in queue.failed_job_registry.get_job_ids()
    job = _fetch(h, job)  # it reads again: the field RQ could not read is gone (its value is in the reason)
    assert job.get_status() == JobStatus.FAILED and job.started_at is None
    reason = job.latest_result().exc_string
    assert job.latest_result().type == Result.Type.FAILED
    assert f"timeout='{BAD_TIMEOUT}'" in reason and "never ran" in reason, reason
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
    q2, before, bad, after = _bad_among_good(h, where, _corrupt)
    try:
        _run_to_exit(h, *([q2.name] if queues == 2 else []))
        _assert_labelled(h, before + after)
        _assert_failed_unreadable(h, bad, q)
        assert q.count == 0 and q.started_job_registry.get_job_ids() == []
        (line,) = _log_events(h, "rq_job_unreadable")
        assert line["job_id"] == bad.id and line["fields"] == ["timeout"] and BAD_TIMEOUT not in str(line)
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
    a refused write) and the job taken out of the list: in no queue or registry. (It is failed after the start now:
    its failure callback no longer holds the accepted jobs in the intermediate list.)"""
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
        assert waits and waits[0]["op"] == "rq_start", waits  # the refused job is failed once the batch started
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


def test_a_subject_is_read_as_the_stream_worker_reads_one():
    """The RQ path ignored ``subject``: the same ticket got another answer than through the stream."""
    read = ticket_text(({"text": "refund me", "subject": " Billing "},), {}, 100)
    assert read == with_subject(" Billing ", "refund me") == "Billing\n\nrefund me"
    assert ticket_text(({"text": "refund me", "subject": "  "},), {}, 100) == "refund me"
    refused = [
        ({"text": "t", "subject": 42}, "ticket subject must be a string, got number"),
        ({"text": "t", "subject": "half \ud83d"}, "ticket subject contains characters that are not valid Unicode"),
        ({"text": "t" * 60, "subject": "s" * 41}, "ticket subject + text is 101 bytes, over the 100-byte limit"),
        ({"text": " ", "subject": "only a subject"}, "ticket text is empty"),
    ]
    for ticket, reason in refused:
        with pytest.raises(InvalidJob, match=re.escape(reason)):
            ticket_text((ticket,), {}, 100)


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


# ------------------------------------------------------------------------ Redis refusing writes: intake, idle, stop
class OutOfMemoryAsAJobIsHandedOverBatchWorker(BatchWorker):
    """Redis runs out of memory right after RQ's dequeue took the first job (before its last heartbeat and the
    batch's fill), until the job's hold (several queues) or the batch's start (one) has been refused: the job is in
    hand, in the intermediate list (one queue) or in no list (several)."""

    def reorder_queues(self, reference_queue):
        super().reorder_queues(reference_queue)
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_until_refused(self.connection, "rq_hold", "rq_start")


@pytest.mark.parametrize("queues", [1, 2], ids=["one-queue", "two-queues"])
def test_redis_refusing_writes_as_a_job_is_handed_over_loses_nothing(rq_setup, queues):
    """RQ's last heartbeat of the dequeue, or the fill's LMOVE pipeline, raised: the worker quit ("found an unhandled
    exception", exit 1) with the job RQ handed over in the intermediate list, later failed as "stuck" by RQ's cleanup,
    or, serving two queues, in no queue or registry at all. Now the fill stops at the refusal (logged once) and the
    batch in hand goes on."""
    with _private_server(rq_setup) as h:
        q2 = Queue("faults-q-2", connection=h.conn, serializer=JSONSerializer)  # served first, empty
        jobs = enqueue_tickets(h.queue, TICKETS[:3])
        _run_to_exit(
            h, *([q2.name] if queues == 2 else []), worker_class=f"{HERE}.OutOfMemoryAsAJobIsHandedOverBatchWorker"
        )
        _assert_labelled(h, jobs)
        assert h.conn.llen(h.queue.intermediate_queue_key) == 0 and h.queue.count == 0
        assert h.queue.started_job_registry.get_job_ids() == [] and h.queue.failed_job_registry.get_job_ids() == []
        assert "unhandled exception" not in h.log.read_text()
        ops = [e["op"] for e in _log_events(h, "redis_unavailable")]
        if queues == 1:  # one queue: the job is listed already; the fill meets the refusal and stops, once
            assert ops.count("rq_fill") == 1 and "rq_start" in ops, ops
        else:  # two: RQ popped the job from no intermediate list; it is listed there before anything else
            assert ops[0] == "rq_hold", ops
        assert sum(b["jobs"] for b in _log_events(h, "rq_batch")) == 3


class _OutOfMemoryAfterTheFirstMove(redis.client.Pipeline):
    """A pipeline that sends its first command alone, then Redis reaches maxmemory, then the rest: the replies a
    pipeline without MULTI gets when Redis runs out of memory between its commands (all from the real server)."""

    def _execute_pipeline(self, connection, commands, raise_on_error):
        first = super()._execute_pipeline(connection, commands[:1], raise_on_error)
        _out_of_memory(redis.Redis(connection_pool=self.connection_pool))
        return first + super()._execute_pipeline(connection, commands[1:], raise_on_error)


class _OutOfMemoryMidFill(redis.Redis):
    def pipeline(self, transaction=True, shard_hint=None):
        if transaction or self.exists("oom-done"):
            return super().pipeline(transaction, shard_hint)
        self.set("oom-done", 1)
        return _OutOfMemoryAfterTheFirstMove(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def test_a_fill_that_redis_refuses_midway_keeps_the_jobs_it_moved_and_leaves_the_rest_queued(rq_setup):
    """The fill's LMOVE pipeline (no MULTI) may apply some moves before Redis refuses the next: the old fill raised,
    and the jobs it had moved sat in the intermediate list, in no batch, until RQ's cleanup failed them as stuck. The
    moved ones (the replies say which) now join the batch; the refused ones were never moved and stay queued."""
    with _private_server(rq_setup) as h:
        conn = _OutOfMemoryMidFill.from_url(h.url)
        queue = Queue(h.queue.name, connection=conn, serializer=JSONSerializer)
        first, *jobs = enqueue_tickets(queue, TICKETS[:4])
        worker = _in_process(conn, [queue.name], h.worker_name)
        batch = [(Job.fetch(first.id, connection=conn, serializer=JSONSerializer), queue)]
        assert conn.lmove(queue.key, queue.intermediate_queue_key).decode() == first.id  # RQ's handover
        try:
            intake.fill(worker, batch, limit=4, max_wait_s=30.0)
        finally:
            h.conn.config_set("maxmemory", 0)
        assert [j.id for j, _ in batch] == [first.id, jobs[0].id]  # the one move applied, then refused
        assert [i.decode() for i in h.conn.lrange(queue.intermediate_queue_key, 0, -1)] == [first.id, jobs[0].id]
        assert queue.get_job_ids() == [j.id for j in jobs[1:]]  # never moved: still queued, in order


def _wait_events(h, proc, event: str, op: str, n: int = 1) -> list[dict]:
    def seen() -> list[dict]:
        return [e for e in _log_events(h, event) if e.get("op") == op]

    _wait_for(lambda: len(seen()) >= n, f"{n} {event} {op}", proc, h, timeout_s=60)
    return seen()


def test_an_idle_worker_waits_out_redis_refusing_writes_and_a_warm_stop_still_ends_it(rq_setup):
    """RQ's dequeue retries only ConnectionError and TimeoutError: an idle worker's dequeue (its heartbeat, BLMOVE)
    meeting an out-of-memory Redis ended the work loop, and the refused register_death made it exit 1 (a supervisor's
    restart loads the model again). It now waits, one redis_unavailable line per try, goes on when Redis takes writes
    again, and a SIGTERM while it waits is still a clean stop."""
    port = free_port()
    with _private_server(rq_setup) as h:
        key = f"rq:worker:{h.worker_name}"
        metrics = {"TRIAGE_METRICS_PORT": str(port), "TRIAGE_METRICS_HOST": "127.0.0.1"}
        with _running(h, "--worker-ttl", "16", **metrics) as proc:  # RQ's dequeue blocks worker_ttl - 15 s at a time
            _wait_for(lambda: h.conn.hget(key, "state") == b"idle", "an idle worker", proc, h, timeout_s=60)
            assert scrape(port)[("triage_redis_reconnects_total", ())] == 0
            _out_of_memory(h.conn)
            waits = _wait_events(h, proc, "redis_unavailable", "rq_dequeue", 2)
            assert "OOM" in waits[0]["error"] or "OutOfMemory" in waits[0]["error"], waits
            h.conn.config_set("maxmemory", 0)
            _wait_events(h, proc, "redis_reconnected", "rq_dequeue")
            assert scrape(port)[("triage_redis_reconnects_total", ())] >= 1  # was registered, and stuck at 0
            jobs = enqueue_tickets(h.queue, TICKETS[:2])
            _wait_for(lambda: h.queue.finished_job_registry.count == 2, "the jobs run", proc, h, timeout_s=60)
            _assert_labelled(h, jobs)
            before = len(_log_events(h, "redis_unavailable"))
            _out_of_memory(h.conn)
            _wait_for(lambda: len(_log_events(h, "redis_unavailable")) > before + 1, "a wait", proc, h, timeout_s=60)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, h.log.read_text()
            h.conn.config_set("maxmemory", 0)
        log = h.log.read_text()
        assert "unhandled exception" not in log and "Traceback" not in log, log
        assert [e["op"] for e in _log_events(h, "redis_unavailable")][-1] == "rq_stop"  # its death: not registered


# ----------------------------------------------------------------- Redis refusing part of a batch's success
class OutOfMemoryAtASlowSuccessBatchWorker(BatchWorker):
    """Redis runs out of memory as the first job with dependents is recorded by RQ's handle_job_success, after the
    batch's plain jobs' MULTI/EXEC applied, until a record has been refused: before its write (TEST_OOM_AT=before) or
    after it, before its mirror."""

    def handle_job_success(self, job, queue, started_job_registry, execution):
        after = os.environ["TEST_OOM_AT"] == "after"
        if after:
            super().handle_job_success(job, queue, started_job_registry, execution)
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_until_refused(self.connection, "rq_record")
        if not after:
            super().handle_job_success(job, queue, started_job_registry, execution)


@contextmanager
def _webhook_endpoint():
    """A local HTTP endpoint for RQ's webhooks; yields its URL and the (job id, status) of each POST it got."""
    got: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((body["job_id"], body["status"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", got
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("oom_at", ["before", "after"], ids=["record-refused", "mirror-refused"])
def test_every_finished_job_gets_one_webhook_and_one_mirror_when_redis_refuses_part_of_a_success(rq_setup, oom_at):
    """The batch's plain jobs were recorded in one MULTI/EXEC, then Redis refused a job with dependents (RQ's
    handle_job_success) or its mirror: the retry recorded only the jobs not recorded yet, and sent webhooks only for
    those, so the plain job's finished webhook never went out (and, its mirror refused, the slow job's neither, nor
    its label to the results stream)."""
    with _private_server(rq_setup) as h, _webhook_endpoint() as (url, got):
        hook = [Webhook(url, "finished", method="POST")]
        plain_job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0], webhooks=hook)
        parent = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[1], webhooks=hook)
        child = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[2], webhooks=hook, depends_on=parent)
        jobs = [plain_job, parent, child]
        _run_to_exit(h, worker_class=f"{HERE}.OutOfMemoryAtASlowSuccessBatchWorker", TEST_OOM_AT=oom_at)
        _assert_labelled(h, jobs)
        assert sorted(got) == sorted((j.id, "finished") for j in jobs), got
        mirrored = [f[b"id"].decode() for _, f in h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])]
        assert sorted(mirrored) == sorted(j.id for j in jobs)
        assert [b["jobs"] for b in _log_events(h, "rq_batch")] == [2, 1]
        assert "rq_record" in [e["op"] for e in _log_events(h, "redis_unavailable")]


# ------------------------------------------------------------------ a lost reply: nothing applied twice
@pytest.mark.parametrize("late", [False, True], ids=["lost", "lost-and-late"])
def test_a_failure_whose_reply_is_lost_is_saved_once(rq_setup, late):
    """A failure whose EXEC ran but whose reply was lost was sent again (redis-py's own retry resends an unwatched
    MULTI, then the worker's wait): a retried job queued twice, its retry counted down twice, the worker's failure
    count doubled, a failed job given two failed Results. ``late``: the lost try reaches Redis only under the retry
    (after its check, before its EXEC): the retry, aborted, was taken for not applied and sent a third time."""
    h = rq_setup
    with _lossy(h.url) as (proxy, conn):
        retried = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0], retry=Retry(max=2))
        failed = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[1])
        h.jobs += [retried, failed]
        worker = _in_process(conn, [h.queue.name], h.worker_name)
        for e in _started(worker, [retried, failed]):
            e.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
            e.job.ended_at = now()
            proxy.drop_at(b"HINCRBY", after=True, late=late)
            outcome.fail(worker, e)
            assert proxy.triggered.wait(10) and (proxy.released.is_set() or not late)
    assert h.queue.get_job_ids() == [retried.id] and _fetch(h, retried).retries_left == 1
    assert len(_fetch(h, failed).results()) == 1 and _fetch(h, failed).get_status() == JobStatus.FAILED
    assert int(h.conn.hget(worker.key, "failed_job_count")) == 2
    assert h.queue.started_job_registry.get_job_ids() == []


@pytest.mark.parametrize("late", [False, True], ids=["lost", "lost-and-late"])
@pytest.mark.parametrize("path", ["plain", "dependents", "repeat"])
def test_a_success_whose_reply_is_lost_is_recorded_once(rq_setup, path, late):
    """The batch's MULTI (plain jobs) or RQ's handle_job_success (a job with dependents or repeats; RQ sends it again
    itself on the WatchError redis-py raises for a lost reply) applied, its reply lost: sent again, the job had two
    Results and two results-stream entries (and, through RQ, its dependent stayed in the ready registry until
    maintenance). ``late``: the lost try reaches Redis only under the retry (after its check, before its EXEC): the
    retry was aborted (plain, dependents) and a third try applied, or (repeat: RQ WATCHes only the dependents) the
    retry applied too."""
    h = rq_setup
    stream = h.env["TRIAGE_RESULTS_STREAM"]
    with _lossy(h.url) as (proxy, conn):
        job = h.queue.enqueue(
            "worker.rq_jobs.classify", TICKETS[0], repeat=Repeat(times=1) if path == "repeat" else None
        )
        child = [h.queue.enqueue("worker.rq_jobs.classify", TICKETS[1], depends_on=job)] if path == "dependents" else []
        h.jobs += [job, *child]
        worker = _in_process(conn, [h.queue.name], h.worker_name)
        entries = _started(worker, [job])
        _classified(entries)
        proxy.drop_at(b"HINCRBY", after=True, late=late)
        _succeed(worker, entries, stream)
        assert proxy.triggered.wait(10) and (proxy.released.is_set() or not late)
    done = _fetch(h, job)
    assert len(done.results()) == 1
    assert [f[b"id"].decode() for _, f in h.conn.xrange(stream)] == [job.id]
    assert int(h.conn.hget(worker.key, "successful_job_count")) == 1
    if path == "repeat":  # queued again once, for its one repeat
        assert done.get_status() == JobStatus.QUEUED and done.repeats_left == 0
        assert h.queue.get_job_ids() == [job.id]
    else:
        assert done.get_status() == JobStatus.FINISHED
        assert h.queue.get_job_ids() == [c.id for c in child]  # the dependent: queued once, now


def test_a_success_whose_reply_is_lost_and_whose_check_is_cut_too_is_waited_out(rq_setup):
    """After a lost reply, the retry's WATCHed read of the landing key lost its connection too: redis-py said so with
    a WatchError, which is no refusal that passes by itself, so it escaped the wait and the batch (RQ quit with the
    jobs STARTED: their failure callbacks ran again once RQ found them abandoned). It is waited out now, and the
    success found applied."""
    h = rq_setup
    stream = h.env["TRIAGE_RESULTS_STREAM"]
    with _lossy(h.url) as (proxy, conn):
        job, worker = _one_job(h, conn)
        entries = _started(worker, [job])
        _classified(entries)
        proxy.drop_at(b"HINCRBY", after=True)  # applied, its reply lost
        proxy.drop_at(b"GET", after=False, first_arg=Landing(worker).key.encode())  # the retry's check, WATCHed
        _succeed(worker, entries, stream)
        assert proxy.triggered.wait(10)
    done = _fetch(h, job)
    assert done.get_status() == JobStatus.FINISHED and len(done.results()) == 1
    assert [f[b"id"].decode() for _, f in h.conn.xrange(stream)] == [job.id]
    assert h.queue.started_job_registry.get_job_ids() == []


def test_an_unreadable_jobs_failure_landing_late_under_the_retrys_read_is_followed_up(rq_setup):
    """A failure that removes a job's unreadable fields, its reply lost, reached Redis only as the retry read whether
    the fields were still there: the retry had checked the landing key first, found the fields gone and took it for
    another worker's failure, so this one's follow-ups (its failed webhook, dependents, rate-limit slot) never ran.
    The landing key is read after the job's fields now."""
    with _webhook_endpoint() as (url, got), _lossy(rq_setup.url) as (proxy, conn):
        h = rq_setup
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0], webhooks=[Webhook(url, "failed", method="POST")])
        h.jobs.append(job)
        _corrupt(h, job)
        assert h.conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id
        worker = _in_process(conn, [h.queue.name], h.worker_name)
        proxy.drop_at(b"HINCRBY", after=True, late=b"HMGET")
        unreadable.fail_listed(worker, worker.queues[0])
        assert proxy.triggered.wait(10) and proxy.released.is_set()
    _assert_failed_unreadable(h, job, h.queue)
    assert len(_fetch(h, job).results()) == 1
    assert got == [(job.id, "failed")]


def test_a_start_whose_reply_is_lost_and_that_lands_after_the_success_starts_nothing(rq_setup):
    """The batch's start, its reply lost, reached Redis only after the retry had started the jobs and their success
    was recorded: it set the job STARTED again and put its first execution back in the started registry, where RQ's
    cleanup failed the finished job as abandoned once that expired."""
    h = rq_setup
    stream = h.env["TRIAGE_RESULTS_STREAM"]
    with _lossy(h.url) as (proxy, conn):
        job, worker = _one_job(h, conn)
        assert conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id
        entries = [Entry(job=Job.fetch(job.id, connection=conn, serializer=JSONSerializer), queue=worker.queues[0])]
        proxy.drop_at(b"PERSIST", after=True, late=b"ECHO")  # the start's MULTI, held until the test's ECHO
        landing = Landing(worker)
        worker.until_written(lambda: outcome.start(worker, entries, 90, landing), op="rq_start")
        _classified(entries)
        _succeed(worker, entries, stream)
        conn.echo("the lost start arrives")
        assert proxy.triggered.wait(10) and proxy.released.wait(10)
    done = _fetch(h, job)
    assert done.get_status() == JobStatus.FINISHED and len(done.results()) == 1
    assert h.queue.started_job_registry.get_job_ids() == []
    assert [f[b"id"].decode() for _, f in h.conn.xrange(stream)] == [job.id]


def test_a_job_queued_twice_by_a_resent_enqueue_runs_once(rq_setup):
    """redis-py's default ``Redis()`` (which docs/rq.md used) sends an enqueue's MULTI again when its reply is lost:
    the job's id was queued twice, and the batch started, ran and recorded the job twice (two Results, two
    results-stream entries)."""
    h = rq_setup
    job, other = (h.queue.enqueue("worker.rq_jobs.classify", t) for t in TICKETS[:2])
    h.jobs += [job, other]
    h.conn.rpush(h.queue.key, job.id)  # what the enqueue sent again left
    _run_to_exit(h)
    _assert_labelled(h, [job, other])
    assert len(_fetch(h, job).results()) == 1 and h.conn.llen(h.queue.intermediate_queue_key) == 0
    mirrored = [f[b"id"].decode() for _, f in h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])]
    assert sorted(mirrored) == sorted([job.id, other.id])
    assert [e["job_id"] for e in _log_events(h, "rq_job_queued_twice")] == [job.id]


def test_a_copy_of_a_job_already_done_met_in_a_later_batch_is_not_run_again(rq_setup):
    """The resent enqueue's copy is met after its job ran (a later batch): RQ's dequeue and the batch's fill both
    ran it again (a second Result and results-stream entry); a canceled job's copy ran the canceled job. Each
    copy now leaves the queue and the intermediate list without running."""
    h = rq_setup
    done = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
    h.jobs.append(done)
    _run_to_exit(h)
    canceled = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[1])
    canceled.cancel()
    h.jobs.append(canceled)
    h.conn.rpush(h.queue.key, done.id)  # first in the queue: RQ's own dequeue takes it
    fresh = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[2])
    h.jobs.append(fresh)
    h.conn.rpush(h.queue.key, done.id, canceled.id)  # behind a fresh job: the batch's fill takes them
    first_seen = h.queue.intermediate_queue.get_first_seen_key(done.id)
    h.conn.set(first_seen, 1)  # RQ's sighting of it in the intermediate list, from an earlier listing
    _run_to_exit(h)
    assert not h.conn.exists(first_seen)
    _assert_labelled(h, [done, fresh])
    assert len(_fetch(h, done).results()) == 1 and _fetch(h, canceled).get_status() == JobStatus.CANCELED
    assert h.conn.llen(h.queue.key) == 0 and h.conn.llen(h.queue.intermediate_queue_key) == 0
    mirrored = [f[b"id"].decode() for _, f in h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])]
    assert sorted(mirrored) == sorted([done.id, fresh.id])
    skipped = [(e["job_id"], e["status"]) for e in _log_events(h, "rq_job_queued_twice")]
    assert skipped == [(done.id, "finished"), (done.id, "finished"), (canceled.id, "canceled")], skipped


def test_a_repeat_survives_redis_refusing_the_repeating_jobs_success(rq_setup):
    """RQ's Repeat.schedule counts the repeats down in memory before EXEC: the refused try left none, the next one
    recorded the job as a plain success, FINISHED, and it never ran again."""
    with _private_server(rq_setup) as h:
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0], repeat=Repeat(times=1))
        worker = _in_process(h.conn, [h.queue.name], h.worker_name)
        entries = _started(worker, [job])
        _classified(entries)
        _out_of_memory_for(h.conn, 0.5)
        _succeed(worker, entries, h.env["TRIAGE_RESULTS_STREAM"])
        assert h.queue.get_job_ids() == [job.id]  # queued again, for its one repeat
        again = _fetch(h, job)
        assert again.get_status() == JobStatus.QUEUED and again.repeats_left == 0 and len(again.results()) == 1


# -------------------------------------------------------------------- maintenance and the intermediate lists
class _OutOfMemoryOnceLockedQueue(Queue):
    """Redis runs out of memory for 0.5 s just after this queue's first maintenance lock is taken."""

    def acquire_maintenance_lock(self) -> bool:
        got = super().acquire_maintenance_lock()
        if got and not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            _out_of_memory_for(self.connection, 0.5)
        return got


def test_maintenance_refused_after_taking_its_lock_releases_it_and_runs_again(rq_setup):
    """The refusal (RQ's first sighting of a listed job, a SET) escaped with the lock taken; the waited-out rerun
    found the lock held and skipped the queue: its maintenance stopped for 15 minutes (the lock's expiry)."""
    with _private_server(rq_setup) as h:
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
        assert h.conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id  # a dead worker's
        worker = _in_process(h.conn, [h.queue.name], h.worker_name, queue_class=_OutOfMemoryOnceLockedQueue)
        worker.run_maintenance_tasks()
        assert not h.conn.exists(h.queue.registry_cleaning_key)
        assert h.queue.intermediate_queue.get_first_seen(job.id) is not None  # the rerun did the cleanup


def _two_workers_fail_listed(h, job) -> None:
    """``job`` left in the intermediate list; two workers fail what they cannot read there at once, while Redis
    refuses writes for 0.7 s (so both read the job before either writes)."""
    assert h.conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id
    workers = [_in_process(h.conn, [h.queue.name], f"{h.worker_name}-{i}") for i in range(2)]
    _out_of_memory_for(h.conn, 0.7)
    threads = [threading.Thread(target=unreadable.fail_listed, args=(w, w.queues[0])) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


def test_two_workers_failing_the_same_unreadable_job_save_one_failure(rq_setup):
    """Each worker's maintenance failed the unreadable jobs of the intermediate lists outside RQ's lock, and a
    refusal waited out let both read the job before either wrote: two failures saved (two failed Results). The
    failure now checks, under WATCH, that the fields it removes are still there."""
    with _private_server(rq_setup) as h:
        job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
        _corrupt(h, job)
        _two_workers_fail_listed(h, job)
        _assert_failed_unreadable(h, job, h.queue)
        assert len(_fetch(h, job).results()) == 1


def test_a_job_listed_again_is_not_failed_for_its_earlier_time_in_the_intermediate_list(rq_setup):
    """RQ's first sighting of a job in an intermediate list (24 h) outlived the job's time there: retried and listed
    again, the job was failed as "stuck in intermediate queue" by the next maintenance run, whatever the fill wait."""
    h = rq_setup
    job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0], retry=Retry(max=1))
    h.jobs.append(job)
    listed = h.queue.intermediate_queue
    h.conn.set(listed.get_first_seen_key(job.id), now().timestamp() - 3600, ex=24 * 3600)  # seen there an hour ago
    worker = _in_process(h.conn, [h.queue.name], h.worker_name)
    (e,) = _started(worker, [job])
    assert not h.conn.exists(listed.get_first_seen_key(job.id))
    e.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
    outcome.fail(worker, e)  # retried: queued again
    assert h.conn.lmove(h.queue.key, h.queue.intermediate_queue_key).decode() == job.id  # the next handover
    listed.cleanup(worker, h.queue)  # RQ's, as any worker's maintenance runs it
    again = _fetch(h, job)
    assert again.get_status() == JobStatus.QUEUED and listed.get_job_ids() == [job.id]
    h.conn.delete(listed.get_first_seen_key(job.id))


class _BusyOnTheFirstJobRead(redis.Redis):
    """Redis answers BUSY (a script running) to the first read of a job hash, as right after RQ popped the job."""

    def hgetall(self, name):
        if name.startswith(Job.redis_job_namespace_prefix) and not getattr(self, "busy_done", False):
            self.busy_done = True
            raise redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or ...")
        return super().hgetall(name)


def test_a_popped_job_whose_read_redis_refuses_for_now_is_read_again_not_lost(rq_setup):
    """RQ attaches the job id to any error reading the job it popped: the worker took a BUSY for an unreadable job,
    read it again without waiting, found it readable and raised: RQ's work loop quit, and with several queues the
    job (popped from no intermediate list) was in no queue or registry."""
    h = rq_setup
    q2 = Queue(h.queue.name + "-2", connection=h.conn, serializer=JSONSerializer)  # served first, empty
    job = h.queue.enqueue("worker.rq_jobs.classify", TICKETS[0])
    h.jobs.append(job)
    conn = _BusyOnTheFirstJobRead.from_url(h.url)
    worker = _in_process(conn, [q2.name, h.queue.name], h.worker_name)
    worker.last_cleaned_at = now()  # no maintenance run here
    got, queue = worker.dequeue_job_and_maintain_ttl(None)
    assert conn.busy_done and got.id == job.id and queue.name == h.queue.name
    assert got.func_name == "worker.rq_jobs.classify"
