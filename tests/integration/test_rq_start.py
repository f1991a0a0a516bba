"""The RQ batch worker starting while Redis refuses writes: its registration waits, then it runs; a warm stop meanwhile
exits 0. Real Redis (a private server: the tests set maxmemory or reload it), real ``rq worker`` processes, the tiny
model. What ``rq worker`` itself does before the worker class runs is pinned here too (docs/rq.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Callback
from rq.job import JobStatus

from producer.rq_client import enqueue_tickets
from tests.holds import hold
from tests.integration import test_rq
from tests.integration.test_rq import TICKETS, _assert_labelled, _log_events, _run_to_exit, _running, _wait_for
from tests.integration.test_rq_faults import _fetch, _in_process, _out_of_memory, _private_server, _wait_events
from tests.tcp_proxy import TcpProxy
from worker.rqbatch import BatchWorker

HERE = "tests.integration.test_rq_start"
rq_setup = test_rq.rq_setup
RELOAD_KEYS = 300  # each 2 KB: with key-load-delay 100 ms, a reload answers LOADING for up to 30 s


def note_statuses(job, connection, exc_type, exc_value, tb):
    """An on_failure callback (allowed in the test that uses it): notes, as it runs, the status of the jobs named in
    ``meta["watch"]``."""
    statuses = [connection.hget(f"rq:job:{i}", "status").decode() for i in job.meta["watch"]]
    connection.set(job.meta["mark"], ",".join(statuses), ex=600)


def _slow_reload(conn: redis.Redis) -> None:
    """Redis reloads its data set (DEBUG RELOAD), a key per 100 ms (key-load-delay), answering LOADING meanwhile;
    returns once it does. The test ends it early with ``CONFIG SET key-load-delay 0``."""
    conn.config_set("loading-process-events-interval-bytes", 1024)  # it answers other clients between two keys
    conn.config_set("key-load-delay", 100_000)
    kw = conn.connection_pool.connection_kwargs
    where = {"host": kw["host"], "port": kw["port"], "db": kw.get("db", 0)}
    threading.Thread(target=lambda: redis.Redis(**where).execute_command("DEBUG", "RELOAD"), daemon=True).start()
    probe = redis.Redis(**where, retry=Retry(NoBackoff(), 0))  # redis-py retries LOADING (a ConnectionError) itself
    while True:
        try:
            probe.exists("probe")
        except redis.BusyLoadingError:
            return


def _cut_off(conn: redis.Redis, queue: str) -> None:
    """Marks ``<queue>:at-birth`` for the test, which then cuts the TCP proxy this worker reaches Redis through;
    returns once Redis is out of reach."""
    conn.set(queue + ":at-birth", 1, ex=600)
    while True:
        try:
            conn.ping()
        except redis.ConnectionError:
            return


class RefusedAtBirthBatchWorker(BatchWorker):
    """Redis refuses the worker's registration (RQ's register_birth, right after the model loaded) as PYTEST_RQ_REFUSAL
    says, until the test ends it: ``oom`` (maxmemory 1, noeviction), ``loading`` (a slow DEBUG RELOAD), ``down``
    (the TCP proxy to Redis cut)."""

    def register_birth(self):
        how = os.environ["PYTEST_RQ_REFUSAL"]
        if how == "oom":
            _out_of_memory(self.connection)
        elif how == "loading":
            _slow_reload(self.connection)
        else:
            _cut_off(self.connection, self.queue_names()[0])
        super().register_birth()


@contextmanager
def _server(rq_setup, how: str):
    """The private server for ``how``, and a function that ends the refusal; ``down``: the worker's --url is a TCP
    proxy to it, which the end-function cuts first (once the worker is at its registration) and then restores."""
    with _private_server(rq_setup, "enable-debug-command yes") as h:
        if how == "loading":  # a data set to reload
            with h.conn.pipeline(transaction=False) as pipe:
                for i in range(RELOAD_KEYS):
                    pipe.set(f"reload:{i}", os.urandom(2048))  # not compressible: each key is 2 KB to load
                pipe.execute()
        if how != "down":
            end = {"oom": lambda: h.conn.config_set("maxmemory", 0), "loading": lambda: _end_reload(h.conn)}[how]
            yield h, (lambda proc: None), end
            return
        kw = h.conn.connection_pool.connection_kwargs
        with TcpProxy(kw["host"], kw["port"]) as proxy:
            via = SimpleNamespace(**{**vars(h), "url": f"redis://127.0.0.1:{proxy.port}/0"})

            def cut(proc) -> None:
                _wait_for(lambda: h.conn.exists(h.queue.name + ":at-birth"), "the registration", proc, h)
                proxy.cut()

            yield via, cut, proxy.restore


def _end_reload(conn: redis.Redis) -> None:
    conn.config_set("key-load-delay", 0)  # CONFIG is answered while loading


REFUSED = {"oom": "OutOfMemoryError", "loading": "BusyLoadingError", "down": "ConnectionError"}


@pytest.mark.parametrize("how", ["oom", "loading", "down"])
def test_a_worker_starting_while_redis_refuses_writes_waits_then_runs_the_jobs(rq_setup, how):
    """RQ's register_birth, right after the model loaded (minutes on a GPU), raised: ``rq worker`` exited 1, and a
    supervisor's restart loaded the model again into the same refusal. The registration now waits (one
    redis_unavailable line per try, then redis_reconnected) and the worker goes on with the model it has."""
    with _server(rq_setup, how) as (h, before, end):
        jobs = enqueue_tickets(h.queue, TICKETS[:3])
        with _running(h, "--burst", worker_class=f"{HERE}.RefusedAtBirthBatchWorker", PYTEST_RQ_REFUSAL=how) as proc:
            before(proc)
            waits = _wait_events(h, proc, "redis_unavailable", "rq_birth", 2 if how == "oom" else 1)
            assert REFUSED[how] in waits[0]["error"], waits
            end()
            assert proc.wait(timeout=120) == 0, h.log.read_text()
        _assert_labelled(h, jobs)
        assert [e["op"] for e in _log_events(h, "redis_reconnected")][:1] == ["rq_birth"]
        assert len(_log_events(h, "rq_worker_ready")) == 1  # the model loaded once
        assert h.conn.hexists(f"rq:worker:{h.worker_name}", "death")  # registered, then its death at the end
        assert "Traceback" not in h.log.read_text()


def test_a_warm_stop_while_the_start_waits_for_redis_exits_0_and_leaves_the_jobs_queued(rq_setup):
    """RQ installs its signal handlers after the start: a SIGTERM during the registration killed the process (and
    without it, the refused registration exited 1 anyway)."""
    with _private_server(rq_setup) as h:
        jobs = enqueue_tickets(h.queue, TICKETS[:2])
        with _running(h, worker_class=f"{HERE}.RefusedAtBirthBatchWorker", PYTEST_RQ_REFUSAL="oom") as proc:
            _wait_events(h, proc, "redis_unavailable", "rq_birth", 1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, h.log.read_text()
        h.conn.config_set("maxmemory", 0)
        assert h.queue.get_job_ids() == [j.id for j in jobs]
        assert not h.conn.exists(f"rq:worker:{h.worker_name}") and not h.conn.smembers("rq:workers")
        assert "Traceback" not in h.log.read_text()


class SlowStartBatchWorker(BatchWorker):
    """Its model's start is held once the model is up (as a long load on a GPU box is), until the test releases it:
    the key PYTEST_RQ_START_MARK is set while it waits for PYTEST_RQ_START_GO. Patched in the worker's process only
    (RQ builds the class there)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from worker import model_start

        start_model, conn = model_start.start_model, self.connection

        def held(*a, **kw):
            out = start_model(*a, **kw)
            hold(conn, mark_key=os.environ["PYTEST_RQ_START_MARK"], until_key=os.environ["PYTEST_RQ_START_GO"])
            return out

        model_start.start_model = held


def test_a_warm_stop_while_the_model_loads_exits_0_before_taking_a_job(rq_setup):
    """RQ installs its signal handlers when its loop starts: a SIGTERM while the model loaded (minutes on a GPU box)
    killed the process (-15) instead of the warm stop the docs describe. A second signal still exits at once."""
    h = rq_setup
    jobs = enqueue_tickets(h.queue, TICKETS[:2])
    h.jobs += jobs
    mark, go = h.queue.key + ":start-held", h.queue.key + ":start-go"
    worker_class = f"{HERE}.SlowStartBatchWorker"
    with _running(h, worker_class=worker_class, PYTEST_RQ_START_MARK=mark, PYTEST_RQ_START_GO=go) as proc:
        _wait_for(lambda: h.conn.exists(mark), "the start held", proc, h)
        proc.send_signal(signal.SIGTERM)
        h.conn.set(go, 1, ex=60)
        assert proc.wait(timeout=60) == 0, h.log.read_text()
    assert h.queue.get_job_ids() == [j.id for j in jobs]  # nothing taken
    assert not h.conn.exists(f"rq:worker:{h.worker_name}")  # never registered
    assert "Traceback" not in h.log.read_text()
    h.conn.delete(mark, go)


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (``SigCgt`` in /proc): False once it is gone, or ignored."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def test_a_second_signal_during_the_exit_after_a_warm_stop_still_exits_0(rq_setup):
    """After a warm stop the batch is recorded and the worker unregistered, and the interpreter's teardown (~1.6 s
    with torch loaded) reset SIGTERM to its default: a second signal then (docker stop and Ctrl-C, tini -g, a pool)
    killed the finished worker by signal (-15), a --burst job recorded as failed. Signals are ignored from there."""
    h = rq_setup
    jobs = enqueue_tickets(h.queue, TICKETS[:2])
    h.jobs += jobs
    # a real `rq` process: a child of the suite's fork server ends with os._exit, no interpreter teardown
    with _running(h, RQ_TEST_EXEC="1") as proc:
        finished = lambda: all(j.get_status(refresh=True) == JobStatus.FINISHED for j in jobs)  # noqa: E731
        _wait_for(finished, "the jobs to finish", proc, h)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while proc.poll() is None and _catches_sigterm(proc.pid):  # RQ's handler: a second signal is debounced
            assert time.monotonic() < deadline, h.log.read_text()
            time.sleep(0.002)
        if proc.poll() is None:  # in the interpreter's teardown
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, h.log.read_text()
    _assert_labelled(h, jobs)


@pytest.mark.parametrize("late", ["no", "yes", "after-a-second-try"], ids=["lost", "lost-and-late", "two-lost"])
def test_a_registration_whose_reply_was_lost_is_not_taken_for_another_live_worker(rq_setup, late):
    """A registration that Redis applied but whose reply was lost (redis-py's own retries used up): tried again, RQ's
    check found the worker's own fresh key and raised "There exists an active worker named ... already".
    ``late``: the lost try reached Redis only as RQ's check of the retry ran (after the worker's own look);
    ``after-a-second-try``: only under a third try, a second one lost too (each try has its own birth date: the
    worker looked for the last one's)."""
    h = rq_setup
    kw = h.conn.connection_pool.connection_kwargs
    with TcpProxy(kw.get("host", "127.0.0.1"), kw.get("port", 6379)) as proxy:
        conn = redis.Redis(
            port=proxy.port, db=kw.get("db", 0), password=kw.get("password"), retry=Retry(NoBackoff(), 0)
        )
        worker = _in_process(conn, [h.queue.name], h.worker_name)
        # the registration's MULTI: it runs, its reply is lost (held until a later try's check, if late)
        proxy.drop_at(
            b"SADD", after=True, late=b"EXISTS" if late != "no" else False, late_skip=int(late == "after-a-second-try")
        )
        if late == "after-a-second-try":
            proxy.drop_at(b"SADD", after=False)  # the second try's: it never reaches Redis
        worker.register_birth()
        assert proxy.triggered.wait(10) and (proxy.released.is_set() or late == "no")
    assert h.conn.sismember("rq:workers", worker.key) and not h.conn.hexists(worker.key, "death")


def test_rq_worker_exits_1_before_the_worker_class_runs_when_redis_refuses_its_suspension_check(rq_setup):
    """What ``rq worker`` does before the worker class is made (docs/rq.md, "Redis refusing writes"): its suspension
    check, a MULTI that Redis 7 refuses at maxmemory, ends it with exit 1 and RQ's plain-text error, before the model
    loads. Outside the worker class's reach; pinned so that a change in RQ shows here."""
    with _private_server(rq_setup) as h:
        _out_of_memory(h.conn)
        _run_to_exit(h, expect=1)
        h.conn.config_set("maxmemory", 0)
        log = h.log.read_text()
        assert "EXISTS rq:suspended" in log and "OutOfMemoryError" in log, log
        assert not _log_events(h, "rq_worker_ready") and not h.conn.smembers("rq:workers")


def test_the_failure_callbacks_of_refused_jobs_run_once_the_accepted_ones_started(rq_setup):
    """A batch's refused jobs were failed, their failure callbacks first (up to RQ's 60 s each), before its accepted
    jobs started: meanwhile those waited in the intermediate list, where another worker's maintenance fails a job it
    sees twice a minute apart. The refused job is still never STARTED, and is failed before the pass."""
    h, q = rq_setup, rq_setup.queue
    accepted = enqueue_tickets(q, TICKETS[:2])
    mark = q.name + ":statuses"
    refused = q.enqueue(
        "worker.rq_jobs.classify",
        {"txt": "typo"},
        on_failure=Callback(f"{HERE}.note_statuses"),
        meta={"watch": [j.id for j in accepted], "mark": mark},
    )
    h.jobs += [*accepted, refused]
    try:
        _run_to_exit(h, TRIAGE_RQ_ALLOWED_CALLBACKS=f"{HERE}.note_statuses")
        assert h.conn.get(mark) == b"started,started"
    finally:
        h.conn.delete(mark)
    _assert_labelled(h, accepted)
    refused = _fetch(h, refused)
    assert refused.get_status() == JobStatus.FAILED and refused.started_at is None
    assert [b["jobs"] for b in _log_events(h, "rq_batch")] == [3]


def test_unsubscribing_at_exit_never_waits_for_the_pubsub_threads_minute(redis_url, key_prefix):
    """RQ sends UNSUBSCRIBE, then stops its pub/sub thread, which redis-py >= 8 joins with no limit. A thread that
    read the reply first waits 60 s (RQ's sleep_time) for a new subscription: a --burst worker took a minute to
    exit, and its death key (60 s TTL) was gone by then (a flaky CI run). Here the thread is put in that wait on
    purpose; the worker's unsubscribe must still return (at most 1 s of join: a daemon thread is left)."""
    conn = redis.Redis.from_url(redis_url)
    worker = BatchWorker([key_prefix + "q"], connection=conn, name=key_prefix + "w", prepare_for_work=False)
    worker.subscribe()
    _wait_for_true(lambda: worker.pubsub.subscribed)
    worker.pubsub.unsubscribe()  # the reply read by the thread before any stop: it now waits for a subscription
    _wait_for_true(lambda: not worker.pubsub.subscribed)
    done = threading.Event()
    threading.Thread(target=lambda: (worker.unsubscribe(), done.set()), daemon=True).start()
    assert done.wait(30), "unsubscribe waited on the pub/sub thread's 60 s sleep"


def _wait_for_true(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
