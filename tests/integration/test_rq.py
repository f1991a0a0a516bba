"""RQ integration end to end: real Redis, a real ``rq worker`` process with the batch worker class, the tiny model.

Every RQ key a test creates is removed at the end (its jobs through RQ's own
Job.delete, then the queue's, registries' and worker's keys by their unique name).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen
from types import SimpleNamespace

import pytest
import redis
from rq import Callback, Queue, Retry, SimpleWorker
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.rq_client import enqueue_ticket, enqueue_tickets, triage_queue
from tests import zygote
from tests.holds import hold
from tests.metrics_scrape import scrape
from worker import rq_jobs
from worker.bench.redis_mode import log_events
from worker.engine.task import DEFAULT_LABELS
from worker.redis_server import free_port
from worker.rqbatch import BatchWorker, plain

REPO = Path(__file__).resolve().parents[2]
WORKER_IDLE = ("triage_worker_phase", (("phase", "idle"),))
WORKER_INFERRING = ("triage_worker_phase", (("phase", "inferring"),))
WORKER_STOPPING = ("triage_worker_phase", (("phase", "stopping"),))
RQ_CLI = str(Path(sys.executable).with_name("rq"))
LABELS = set(DEFAULT_LABELS)
TICKETS = [
    "I was charged twice for my subscription, please refund me.",
    "The app crashes when I open settings.",
    "My password reset email never arrives.",
    "Where is my package? Tracking has not moved for ten days and support keeps telling me to wait.",
    "Do you offer discounts for non-profits?",
]


def record_failure(job, connection, exc_type, exc_value, tb):
    """An on_failure callback (allowed via TRIAGE_RQ_ALLOWED_CALLBACKS in the test): leaves a mark in Redis."""
    connection.set(job.meta["mark"], exc_type.__name__, ex=600)


class HeldPassBatchWorker(BatchWorker):
    """The real batch worker whose forward pass waits (a long pass on a big model) until the test sets
    ``<queue>:release``, or for ten minutes: it marks ``<queue>:in-pass`` with the pass's job ids, so a test can
    stop or kill -9 it mid-pass."""

    def _classify(self, entries):
        queue = self.queue_names()[0]
        ids = ",".join(e.job.id for e in entries)
        hold(self.connection, mark_key=queue + ":in-pass", mark_value=ids, until_key=queue + ":release")
        return super()._classify(entries)


class FailingPassBatchWorker(BatchWorker):
    """The real batch worker whose engine fails every forward call that holds a ticket of over 200 tokens, as an
    out-of-memory or a kernel error on one odd ticket would; everything else goes through the real engine."""

    def bootstrap(self, *args, **kwargs):
        super().bootstrap(*args, **kwargs)
        real = self.clf.classify_passes

        def classify_passes(items, passes=None, **run):
            for p in passes:
                if any(items[i].n_text_tokens > 200 for i in p.indices):
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                yield from real(items, [p], **run)

        self.clf.classify_passes = classify_passes


class FailingTokenizerBatchWorker(BatchWorker):
    """The real batch worker whose tokenizer raises on any text holding ``BREAK-TOKENIZER``, as a real one does on
    input no check foresaw; everything else goes through the real engine."""

    def bootstrap(self, *args, **kwargs):
        super().bootstrap(*args, **kwargs)
        real = self.clf.prepare

        def prepare(texts):
            if any("BREAK-TOKENIZER" in t for t in texts):
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
            return real(texts)

        self.clf.prepare = prepare


class OutOfMemoryAfterClassifyBatchWorker(BatchWorker):
    """Redis runs out of memory (noeviction) right after the batch is classified, for 2 s: the labels are in hand
    when every write is refused."""

    def _classify(self, entries):
        import threading

        out = super()._classify(entries)
        if not self.connection.exists("oom-done"):
            self.connection.set("oom-done", 1)
            self.connection.config_set("maxmemory-policy", "noeviction")
            self.connection.config_set("maxmemory", 1)
            threading.Timer(2.0, lambda: self.connection.config_set("maxmemory", 0)).start()
        return out


class WatchedOutcomeBatchWorker(FailingPassBatchWorker):
    """The failing-pass worker that notes, as it records each job's outcome, whether the batch heartbeat still beats
    (``<queue>:heartbeat-while-recording``, one "1"/"0" per succeed / fail call): finished jobs' webhooks can take
    10 s each, and the failed jobs' executions must not expire meanwhile."""

    def bootstrap(self, *args, **kwargs):
        import threading

        from worker.rqbatch import outcome

        super().bootstrap(*args, **kwargs)
        key = self.queue_names()[0] + ":heartbeat-while-recording"

        def watched(fn):
            def call(*a, **k):
                beating = any(t.name == "rq-batch-heartbeat" and t.is_alive() for t in threading.enumerate())
                self.connection.rpush(key, "1" if beating else "0")
                self.connection.expire(key, 600)
                return fn(*a, **k)

            return call

        outcome.succeed, outcome.fail = watched(outcome.succeed), watched(outcome.fail)


class TouchOnUnpickle:
    """Pickles to a call that creates a file: proof that the worker never unpickles a payload."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture
def rq_setup(redis_url, key_prefix, triage_env, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    h = SimpleNamespace(
        conn=conn,
        url=redis_url,
        queue=Queue(key_prefix + "q", connection=conn, serializer=JSONSerializer),
        worker_name=(key_prefix + "w").replace(":", "-"),
        jobs=[],
        env=dict(triage_env),
        log=tmp_path / "worker.log",
    )
    yield h
    _delete_rq_keys(h, key_prefix)


def _delete_rq_keys(h, key_prefix: str) -> None:
    for job in h.jobs:
        try:
            Job.fetch(job.id, connection=h.conn, serializer=JSONSerializer).delete()
        except NoSuchJobError:
            pass
        except Exception:  # a pickled job cannot be read back with JSON: delete its keys by name
            h.conn.delete(Job.key_for(job.id), Result.get_key(job.id), f"rq:executions:{job.id}")
    h.queue.delete(delete_jobs=True)
    names = (h.queue.name, h.worker_name)
    keys = [k for k in h.conn.scan_iter(match="rq:*", count=1000) if any(n in k.decode() for n in names)]
    if keys:
        h.conn.delete(*keys)
    h.conn.srem("rq:workers", f"rq:worker:{h.worker_name}")


@contextmanager
def _running(h, *flags: str, worker_class: str = "worker.rqbatch.BatchWorker", **env: str) -> Iterator[Popen]:
    """An ``rq worker`` process (logging to ``h.log``) for the block; killed at its end if still running. Forked from
    the suite's fork server when that is indistinguishable from a fresh ``rq`` (``tests.zygote``): the interpreter's
    torch import is most of a start."""
    args = ["worker", "--worker-class", worker_class, "--serializer", "rq.serializers.JSONSerializer"]
    args += ["--url", h.url, "--name", h.worker_name, *flags, h.queue.name]
    run_env = {**h.env, **env}
    with open(h.log, "wb") as log:
        if zygote.forkable(run_env):
            proc = zygote.shared().spawn(run_env, ["rq", *args], output=log)
        else:
            proc = subprocess.Popen([RQ_CLI, *args], cwd=REPO, env=run_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_to_exit(h, *flags: str, expect: int = 0, **kw: str) -> None:
    """Run a batch worker with --burst until it exits on its own (queue empty, or a start-up error): with ``expect``."""
    with _running(h, "--burst", *flags, **kw) as proc:
        assert proc.wait(timeout=120) == expect, h.log.read_text()


def _assert_labelled(h, jobs) -> None:
    """Every job finished, with a label of the task as its return value."""
    for job in jobs:
        job = Job.fetch(job.id, connection=h.conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FINISHED and job.return_value()["label"] in LABELS


def _log_events(h, event: str) -> list[dict]:
    return [e for e in log_events(h.log.read_text(errors="replace")) if e.get("event") == event]


def _wait_for(predicate, what: str, proc: Popen, h, timeout_s: float = 120.0) -> None:
    """Poll ``predicate``; fail at once, with the worker's log, if the worker ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None and not predicate():  # (it may have come true just before the exit)
            raise AssertionError(f"the worker exited {proc.returncode} before {what}:\n{h.log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_batch_worker_labels_rq_jobs_in_batches_and_fails_bad_ones_alone(rq_setup, tmp_path):
    h, q = rq_setup, rq_setup.queue
    good = [q.enqueue("worker.rq_jobs.classify", {"text": f"{TICKETS[i % 5]} #{i}"}) for i in range(60)]
    good += enqueue_tickets(q, [TICKETS[i % 5] for i in range(40)])  # RQ enqueue_many
    with_subject_field = q.enqueue("worker.rq_jobs.classify", {"subject": "Invoice", "text": TICKETS[0]})
    subject_in_text = q.enqueue("worker.rq_jobs.classify", {"text": f"Invoice\n\n{TICKETS[0]}"})
    text_alone = q.enqueue("worker.rq_jobs.classify", {"text": TICKETS[0]})
    good += [with_subject_field, subject_in_text, text_alone]
    mark = h.queue.name + ":failure-callback"
    no_text = q.enqueue(
        "worker.rq_jobs.classify",
        {"txt": "typo"},
        on_failure=Callback("tests.integration.test_rq.record_failure"),
        meta={"mark": mark},
    )
    wrong_type = q.enqueue("worker.rq_jobs.classify", {"text": 42}, retry=Retry(max=1))
    empty = enqueue_ticket(q, "   ")
    sentinel = tmp_path / "must-survive"
    sentinel.touch()
    other_func = q.enqueue("os.remove", str(sentinel))
    bad_callback = q.enqueue("worker.rq_jobs.classify", {"text": "hi"}, on_success=Callback("os.getcwd"))
    pickled_proof = tmp_path / "unpickled"
    pickled = Queue(q.name, connection=h.conn).enqueue("worker.rq_jobs.classify", TouchOnUnpickle(pickled_proof))
    half_emoji = enqueue_ticket(q, "hello \ud83d world")  # JSON carries the lone surrogate; no tokenizer takes it
    bad = [no_text, wrong_type, empty, other_func, bad_callback, pickled, half_emoji]
    h.jobs += good + bad

    _run_to_exit(h, TRIAGE_RQ_ALLOWED_CALLBACKS="tests.integration.test_rq.record_failure")

    for job in good:
        job = Job.fetch(job.id, connection=h.conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FINISHED
        value = job.return_value()
        assert value["label"] in LABELS and set(value["scores"]) == LABELS
        assert job.latest_result().type == Result.Type.SUCCESSFUL
    assert set(q.finished_job_registry.get_job_ids()) == {j.id for j in good}
    scores = [  # the subject is read, as the stream worker reads it: subject, blank line, text
        Job.fetch(j.id, connection=h.conn, serializer=JSONSerializer).return_value()["scores"]
        for j in (with_subject_field, subject_in_text, text_alone)
    ]
    assert scores[0] == scores[1] != scores[2]
    assert q.started_job_registry.get_job_ids() == []
    assert q.count == 0

    failed_ids = set(q.failed_job_registry.get_job_ids())
    reasons = {
        no_text.id: "ticket has no 'text' field",
        wrong_type.id: "ticket text must be a string, got number",
        empty.id: "ticket text is empty",
        other_func.id: "only runs worker.rq_jobs.classify; refused to run 'os.remove'",
        bad_callback.id: "callback(s) not allowed: on_success=os.getcwd",
        pickled.id: "job payload is not JSON",
        half_emoji.id: "not valid Unicode (a lone surrogate at position 6",
    }
    for job_id, reason in reasons.items():
        job = Job.fetch(job_id, connection=h.conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FAILED and job_id in failed_ids
        assert reason in job.latest_result().exc_string
        # no failure_ttl given: the failed Result lives as long as the job (RQ's 1-year default), never forever (RQ
        # saves it with no expiry: ~5 KB a failed job that a soak hunt saw pile up)
        assert 0 < h.conn.ttl(Result.get_key(job_id)) <= DEFAULT_FAILURE_TTL
    assert sentinel.exists() and not pickled_proof.exists()  # nothing of a job but classify ever ran
    assert Job.fetch(wrong_type.id, connection=h.conn, serializer=JSONSerializer).retries_left == 0  # retried once
    assert h.conn.get(mark) == b"InvalidJob"  # the allowed failure callback ran
    h.conn.delete(mark)

    results = h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])
    mirrored = {f[b"id"].decode(): f[b"label"].decode() for _, f in results}
    assert all(f[b"stream_id"].decode() == "rq:" + f[b"id"].decode() for _, f in results)  # the de-duplication key
    assert mirrored == {
        j.id: Job.fetch(j.id, connection=h.conn, serializer=JSONSerializer).return_value()["label"] for j in good
    }

    ready = _log_events(h, "rq_worker_ready")  # started as the stream worker is: same facts, no graphs on a CPU
    assert len(ready) == 1 and ready[0]["cuda_graphs_warm_up"] is None
    assert ready[0]["tokenize_threads"] >= 1 and ready[0]["torch_threads"] >= 1 and ready[0]["load_ms"] > 0
    batches = _log_events(h, "rq_batch")
    assert sum(b["jobs"] for b in batches) == len(good) + len(bad) + 1  # + the retry of wrong_type
    assert len(batches) <= 6 and sum(b["forward_passes"] for b in batches) <= 12  # not one pass per job


def test_redis_out_of_memory_while_recording_a_batch_is_waited_out_not_a_crash(rq_setup):
    """The refused MULTI/EXEC escaped the batch: RQ quit the worker (exit 1), and its registry cleanup later failed
    the labelled jobs as abandoned. Now the recording is retried until Redis takes it (a private server: the test
    sets maxmemory)."""
    from worker.redis_server import PrivateRedis, find_server_binary

    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server to start privately")
    with PrivateRedis(binary=binary) as server:
        conn = redis.Redis.from_url(server.url)
        h = SimpleNamespace(
            conn=conn,
            url=server.url,
            queue=Queue("oom-q", connection=conn, serializer=JSONSerializer),
            worker_name="oom-w",
            env={**rq_setup.env, "TRIAGE_REDIS_URL": server.url, "TRIAGE_RECONNECT_MAX_S": "0.5"},
            log=rq_setup.log,
        )
        jobs = enqueue_tickets(h.queue, TICKETS[:4])
        _run_to_exit(h, worker_class="tests.integration.test_rq.OutOfMemoryAfterClassifyBatchWorker")
        _assert_labelled(h, jobs)
        waits = [e for e in _log_events(h, "redis_unavailable") if e.get("op") == "rq_record"]
        assert waits and ("OutOfMemory" in waits[0]["error"] or "OOM" in waits[0]["error"]), waits
        assert len(h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])) == 4  # each label mirrored once


def test_a_failing_pass_fails_only_the_job_that_breaks_it(rq_setup):
    """As in the stream worker: the pass is re-run job by job, its other jobs and the other passes finish."""
    h, q = rq_setup, rq_setup.queue
    good = enqueue_tickets(q, [TICKETS[i % 5] for i in range(12)])
    breaker = enqueue_ticket(q, "My order never arrived and nobody answers. " * 40)  # the one over 200 tokens
    h.jobs += [*good, breaker]
    one_pass = {"TRIAGE_PASS_MAX_TOKENS": "100000", "TRIAGE_PASS_OVERHEAD_TOKENS": "100000"}  # all in one pass
    _run_to_exit(h, worker_class="tests.integration.test_rq.FailingPassBatchWorker", **one_pass)
    _assert_labelled(h, good)
    breaker = Job.fetch(breaker.id, connection=h.conn, serializer=JSONSerializer)
    assert breaker.get_status() == JobStatus.FAILED
    assert "illegal memory access" in breaker.latest_result().exc_string
    batches = _log_events(h, "rq_batch")
    assert sum(b["finished"] for b in batches) == 12 and sum(b["failed"] for b in batches) == 1
    assert sum(b["split_retries"] for b in batches) == 13  # the breaker's pass held all 13: each re-run alone


def test_a_ticket_the_tokenizer_rejects_fails_only_its_own_job(rq_setup):
    """The batch is tokenized in one call; when that raises, ticket by ticket, as a failed pass is re-run."""
    h, q = rq_setup, rq_setup.queue
    good = enqueue_tickets(q, TICKETS[:4])
    breaker = enqueue_ticket(q, "BREAK-TOKENIZER please")
    h.jobs += [*good, breaker]
    _run_to_exit(h, worker_class="tests.integration.test_rq.FailingTokenizerBatchWorker")
    _assert_labelled(h, good)
    breaker = Job.fetch(breaker.id, connection=h.conn, serializer=JSONSerializer)
    assert breaker.get_status() == JobStatus.FAILED and "TextEncodeInput" in breaker.latest_result().exc_string


def test_the_batch_heartbeat_beats_until_every_job_of_the_batch_is_recorded(rq_setup):
    """Finished jobs' webhooks are sent before the failed jobs are recorded; a heartbeat that stopped before them
    let those executions expire, and any worker's registry cleanup then failed the jobs a second time (callbacks
    and retries run twice)."""
    h, q = rq_setup, rq_setup.queue
    good = enqueue_tickets(q, TICKETS[:3])
    breaker = enqueue_ticket(q, "My order never arrived and nobody answers. " * 40)
    h.jobs += [*good, breaker]
    _run_to_exit(h, worker_class="tests.integration.test_rq.WatchedOutcomeBatchWorker")
    _assert_labelled(h, good)
    assert Job.fetch(breaker.id, connection=h.conn, serializer=JSONSerializer).get_status() == JobStatus.FAILED
    seen = h.conn.lrange(q.name + ":heartbeat-while-recording", 0, -1)
    h.conn.delete(q.name + ":heartbeat-while-recording")
    assert seen and set(seen) == {b"1"}, seen


def test_metrics_count_the_batch_workers_jobs_passes_and_failures(rq_setup):
    """TRIAGE_METRICS_PORT on the RQ batch worker: the stream worker's ticket and pass metrics, over real HTTP."""
    h, q = rq_setup, rq_setup.queue
    good = enqueue_tickets(q, [TICKETS[i % 5] for i in range(8)])
    no_text = q.enqueue("worker.rq_jobs.classify", {"txt": "typo"})
    empty = enqueue_ticket(q, "   ")
    h.jobs += [*good, no_text, empty]
    port = free_port()
    with _running(h, TRIAGE_METRICS_PORT=str(port), TRIAGE_METRICS_HOST="127.0.0.1") as proc:
        m: dict = {}

        def settled_and_idle() -> bool:
            nonlocal m
            try:
                m = scrape(port)
            except OSError:  # not serving yet
                return False
            return m.get(("triage_request_count_total", ())) == 10 and m.get(WORKER_IDLE) == 1

        _wait_for(settled_and_idle, "the batch in the metrics", proc, h)
        assert m[("triage_request_success_total", ())] == 8
        assert m[("triage_request_failure_total", (("reason", "no_text"),))] == 1
        assert m[("triage_request_failure_total", (("reason", "empty_text"),))] == 1
        assert m[("triage_request_duration_seconds_count", ())] == 8
        assert m[("triage_batch_next_size_sum", ())] == 8  # every classified ticket went through a counted pass
        assert m[("triage_real_tokens_total", ())] > 0
        info = next(labels for (name, labels), _ in m.items() if name == "triage_model_info")
        assert dict(info)["consumer"] == h.worker_name and dict(info)["device"] == "cpu"
        # windows and the group's queue are the stream worker's: no series that would sit at 0 (a "stalled" worker)
        assert not {n for n, _ in m} & {
            "triage_window_size_count",
            "triage_queue_size",
            "triage_last_window_timestamp_seconds",
        }
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_a_warm_stop_mid_pass_shows_stopping_in_the_metrics_and_finishes_the_batch(rq_setup):
    """SIGTERM during a long pass: RQ's handler only sets its flag; the batch heartbeat's next beat moves the phase
    gauge to ``stopping`` (ops see a worker finishing its batch, not a busy one), then the batch is recorded."""
    h, q = rq_setup, rq_setup.queue
    jobs = enqueue_tickets(q, TICKETS[:3])
    h.jobs += jobs
    port = free_port()
    held = "tests.integration.test_rq.HeldPassBatchWorker"
    metrics = {"TRIAGE_METRICS_PORT": str(port), "TRIAGE_METRICS_HOST": "127.0.0.1"}
    with _running(h, "--job-monitoring-interval", "1", worker_class=held, **metrics) as proc:
        _wait_for(lambda: h.conn.exists(q.name + ":in-pass"), "the batch's pass", proc, h)
        assert scrape(port)[WORKER_INFERRING] == 1
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: scrape(port)[WORKER_STOPPING] == 1, "the phase gauge to say stopping", proc, h)
        assert scrape(port)[WORKER_INFERRING] == 0
        h.conn.set(q.name + ":release", 1, ex=600)
        assert proc.wait(timeout=60) == 0, h.log.read_text()
    _assert_labelled(h, jobs)


def test_a_metrics_port_in_use_stops_the_batch_worker_before_the_model_loads(rq_setup):
    h = rq_setup
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _run_to_exit(h, expect=2, TRIAGE_METRICS_PORT=str(port), TRIAGE_METRICS_HOST="127.0.0.1")
    (err,) = _log_events(h, "metrics_unavailable")
    assert err["port"] == port and "TRIAGE_METRICS_PORT" in err["fix"]
    assert not _log_events(h, "rq_worker_ready")


def test_sigterm_finishes_the_batch_in_hand_and_leaves_queued_jobs(rq_setup):
    h, q = rq_setup, rq_setup.queue
    in_hand = enqueue_tickets(q, TICKETS[:3])
    h.jobs += in_hand
    # A long fill wait (capped at 30 s, and said so): the worker holds these 3 jobs, waiting for more, when SIGTERM
    # arrives.
    worker_key = f"rq:worker:{h.worker_name}"
    with _running(h, TRIAGE_WINDOW_MAX_ITEMS="8", TRIAGE_MAX_WAIT_MS="60000") as proc:
        _wait_for(
            lambda: q.count == 0 and h.conn.hget(worker_key, "state") == b"busy",
            "the worker to take the batch",
            proc,
            h,
        )
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: h.conn.hexists(worker_key, "shutdown_requested_date"), "the warm shutdown request", proc, h)
        late = enqueue_tickets(q, TICKETS[3:5])
        h.jobs += late
        assert proc.wait(timeout=60) == 0, h.log.read_text()
    _assert_labelled(h, in_hand)
    for job in late:
        assert Job.fetch(job.id, connection=h.conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    assert q.get_job_ids() == [j.id for j in late]
    assert [b["jobs"] for b in _log_events(h, "rq_batch")] == [3]
    (capped,) = _log_events(h, "rq_max_wait_capped")
    assert (capped["requested_ms"], capped["used_ms"], capped["setting"]) == (60000, 30000, "TRIAGE_MAX_WAIT_MS")
    assert _log_events(h, "rq_worker_ready")[0]["max_wait_ms"] == 30000


def test_batch_cap_is_the_stream_workers_window_cap_on_every_device():
    """256 jobs on a CPU, 4,096 on CUDA when TRIAGE_WINDOW_MAX_ITEMS is unset (assemble.window_max_items)."""
    import torch

    from worker.settings import Settings

    def cap(settings, device):
        return BatchWorker.batch_max_items(SimpleNamespace(settings=settings, clf=SimpleNamespace(device=device)))

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert (cap(Settings(), cpu), cap(Settings(), gpu)) == (256, 4096)
    assert cap(Settings(window_max_items=8), gpu) == 8  # set by the user: taken as it is


def test_plain_rq_worker_runs_classify_loading_the_model_once(rq_setup, monkeypatch):
    h, q = rq_setup, rq_setup.queue
    for k, v in h.env.items():
        if k.startswith("TRIAGE_"):
            monkeypatch.setenv(k, v)
    jobs = [enqueue_ticket(q, TICKETS[0]), q.enqueue(rq_jobs.classify, TICKETS[1]), enqueue_ticket(q, {"text": ""})]
    h.jobs += jobs
    plain.engine.cache_clear()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # RQ's own non-forking worker, in this process
        SimpleWorker([q], connection=h.conn, serializer=JSONSerializer, name=h.worker_name).work(burst=True)
        assert plain.engine.cache_info().misses == 1
    finally:
        plain.engine.cache_clear()
        for s, handler in handlers.items():
            signal.signal(s, handler)
    done = [Job.fetch(j.id, connection=h.conn, serializer=JSONSerializer) for j in jobs]
    assert [j.get_status() for j in done] == [JobStatus.FINISHED, JobStatus.FINISHED, JobStatus.FAILED]
    assert all(j.return_value()["label"] in LABELS for j in done[:2])
    assert "ticket text is empty" in done[2].latest_result().exc_string
    mirrored = [(f[b"id"].decode(), f[b"stream_id"].decode()) for _, f in h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])]
    assert mirrored == [(j.id, "rq:" + j.id) for j in done[:2]]


def test_producer_helpers_refuse_pickle_queues(rq_setup):
    pickle_queue = Queue(rq_setup.queue.name, connection=rq_setup.conn)
    with pytest.raises(ValueError, match="JSON"):
        enqueue_ticket(pickle_queue, "hello")
    with pytest.raises(ValueError, match="JSON"):
        enqueue_tickets(pickle_queue, ["hello"])
    assert triage_queue(rq_setup.conn, rq_setup.queue.name).serializer is JSONSerializer
    assert rq_setup.queue.count == 0


def test_started_batch_is_visible_to_rq_and_kept_alive_by_heartbeats(rq_setup):
    """Pure RQ bookkeeping, no model: the batch's jobs are STARTED with executions that heartbeats keep alive."""
    from worker.rqbatch import BatchWorker, intake, outcome
    from worker.rqbatch.heartbeat import BatchHeartbeat
    from worker.rqbatch.jobs import Entry
    from worker.rqbatch.landing import Landing

    h, q = rq_setup, rq_setup.queue
    h.jobs += enqueue_tickets(q, TICKETS[:3])
    w = BatchWorker([q.name], connection=h.conn, name=h.worker_name, job_monitoring_interval=1)
    w.register_birth()
    entries = [Entry(job=j, queue=jq) for j, jq in intake.drain(w, limit=2)]  # takes 2, leaves 1 queued
    assert [e.job.id for e in entries] == [j.id for j in h.jobs[:2]] and q.count == 1
    outcome.start(w, entries, 5, Landing(w))
    assert set(q.started_job_registry.get_job_ids()) == {e.job.id for e in entries}
    assert h.conn.llen(q.intermediate_queue_key) == 0
    assert all(
        Job.fetch(e.job.id, connection=h.conn, serializer=JSONSerializer).get_status() == JobStatus.STARTED
        for e in entries
    )
    assert all(h.conn.ttl(e.execution.key) <= 5 for e in entries)
    BatchHeartbeat(w, entries).beat()
    assert all(h.conn.ttl(e.execution.key) > 5 for e in entries)  # job_monitoring_interval + 60
    w.register_death()


def test_with_several_queues_every_job_taken_waits_in_its_queues_intermediate_list_until_started(rq_setup):
    """RQ pops without an intermediate list when it serves several queues: a worker killed during the fill wait
    (TRIAGE_MAX_WAIT_MS) would lose the jobs it held, in no queue or registry. Kept in the intermediate list,
    RQ's maintenance finds them; the start takes them out."""
    from worker.rqbatch import intake, outcome
    from worker.rqbatch.jobs import Entry
    from worker.rqbatch.landing import Landing

    h, q = rq_setup, rq_setup.queue
    q2 = Queue(q.name + "-2", connection=h.conn, serializer=JSONSerializer)
    h.jobs += enqueue_tickets(q2, TICKETS[:4])
    unreadable = h.jobs[2]
    h.conn.hset(unreadable.key, "created_at", "not a date")  # RQ cannot restore it: failed, never held
    w = BatchWorker([q.name, q2.name], connection=h.conn, name=h.worker_name, job_monitoring_interval=1)
    w.register_birth()
    try:
        first = Job.fetch(h.conn.lpop(q2.key).decode(), connection=h.conn, serializer=JSONSerializer)  # as RQ does
        intake.hold(w, first, q2)
        batch = [(first, q2), *intake.drain(w, limit=3)]  # takes 3 more, one unreadable; leaves none queued
        held = {j.id for j, _ in batch}
        assert len(held) == 3 and unreadable.id not in held and q2.count == 0
        assert unreadable.id in q2.failed_job_registry.get_job_ids()  # test_rq_faults.py: its reason
        # and not the unreadable one: RQ's intermediate-queue cleanup would raise on it, every maintenance run
        assert set(x.decode() for x in h.conn.lrange(q2.intermediate_queue_key, 0, -1)) == held
        outcome.start(w, [Entry(job=j, queue=jq) for j, jq in batch], 5, Landing(w))
        assert h.conn.llen(q2.intermediate_queue_key) == 0
        assert set(q2.started_job_registry.get_job_ids()) == held
    finally:
        w.register_death()
        q2.delete(delete_jobs=True)
        h.conn.delete(q2.intermediate_queue_key)


def test_a_batch_worker_killed_while_filling_from_several_queues_leaves_its_jobs_for_rqs_maintenance(rq_setup):
    """The real worker, through execute_job: the job RQ popped (without an intermediate list, several queues) and
    those the fill took all wait in the intermediate list while the batch fills; kill -9 then loses none."""
    h, q = rq_setup, rq_setup.queue
    q2 = Queue(q.name + "-2", connection=h.conn, serializer=JSONSerializer)
    h.jobs += enqueue_tickets(q2, TICKETS[:3])
    want = {j.id for j in h.jobs}
    listed = lambda: {x.decode() for x in h.conn.lrange(q2.intermediate_queue_key, 0, -1)}  # noqa: E731
    try:
        with _running(h, q2.name, TRIAGE_MAX_WAIT_MS="30000") as proc:  # fills for up to 30 s
            _wait_for(lambda: listed() == want, "the three jobs in the intermediate list", proc, h)
            proc.kill()
            proc.wait(timeout=30)
        assert listed() == want and q2.count == 0 and q2.started_job_registry.get_job_ids() == []
    finally:
        q2.delete(delete_jobs=True)
        h.conn.delete(q2.intermediate_queue_key)


def test_refused_callback_never_runs_after_a_crash_in_the_forward_pass(rq_setup, tmp_path):
    """A job naming a callback outside TRIAGE_RQ_ALLOWED_CALLBACKS is failed before the batch starts:
    after a kill -9 mid-pass, RQ's registry cleanup in another worker finds only the accepted jobs
    abandoned, and the refused job's callbacks are neither imported nor run."""
    h, q = rq_setup, rq_setup.queue
    mark = h.queue.name + ":refused-callback-ran"
    probe = tmp_path / "imported"
    good = enqueue_ticket(q, TICKETS[0])
    refused = q.enqueue(
        "worker.rq_jobs.classify",
        {"text": TICKETS[1]},
        # a real callback, just not an allowed one here
        on_failure=Callback("tests.integration.test_rq.record_failure"),
        on_success=Callback("tests.rq_import_probe.anything"),  # importing this module leaves a file
        meta={"mark": mark},
    )
    h.jobs += [good, refused]
    env = {"TRIAGE_RQ_ALLOWED_CALLBACKS": "tests.integration.test_rq.some_other_callback", "TRIAGE_MAX_WAIT_MS": "2000"}
    held = "tests.integration.test_rq.HeldPassBatchWorker"  # never released: killed mid-pass
    with _running(h, "--job-monitoring-interval", "1", worker_class=held, **env) as proc:
        _wait_for(lambda: h.conn.exists(q.name + ":in-pass"), "the worker to enter the forward pass", proc, h)
        in_pass = h.conn.get(q.name + ":in-pass").decode()
        proc.kill()  # kill -9 mid-pass
        proc.wait(timeout=30)
    # As if its executions' heartbeats had run out (job_monitoring_interval + 60 s later):
    registry = q.started_job_registry
    h.conn.zadd(registry.key, {m: 1 for m in h.conn.zrange(registry.key, 0, -1)}, xx=True)
    # A second, plain RQ worker: its start-up maintenance runs StartedJobRegistry.cleanup.
    second = subprocess.run(
        [
            RQ_CLI,
            "worker",
            "--worker-class",
            "rq.worker.SimpleWorker",
            "--serializer",
            "json",
            "--burst",
            "--url",
            h.url,
            "--name",
            h.worker_name + "-2",
            q.name,
        ],
        cwd=REPO,
        env={**h.env, "TRIAGE_TEST_PROBE_FILE": str(probe)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr
    h.conn.srem("rq:workers", f"rq:worker:{h.worker_name}-2")
    assert h.conn.get(mark) is None, "the refused failure callback ran"
    assert not probe.exists(), "the refused success callback's module was imported"
    assert (
        Job.fetch(good.id, connection=h.conn, serializer=JSONSerializer).get_status() == JobStatus.FAILED
    )  # abandoned
    refused = Job.fetch(refused.id, connection=h.conn, serializer=JSONSerializer)
    assert refused.get_status() == JobStatus.FAILED
    assert "callback(s) not allowed" in refused.latest_result().exc_string
    assert in_pass == good.id  # only the accepted job went into the pass


def test_a_job_hash_written_by_hand_fails_alone_and_odd_timeouts_fail_no_batch(rq_setup):
    """A job whose args are ``null`` (a hash written by hand) raised out of the batch check: the worker quit with exit
    0 and its whole batch waited in the intermediate list for RQ's maintenance to fail it. A job_timeout RQ takes
    but no sum can (-358: the batch's limit became 2 s; 5e9: signal.alarm overflowed) failed every job of its batch."""
    import json
    import zlib

    h, q = rq_setup, rq_setup.queue
    good = [q.enqueue("worker.rq_jobs.classify", {"text": f"{TICKETS[i % 5]} #{i}"}) for i in range(6)]
    odd = [q.enqueue("worker.rq_jobs.classify", {"text": TICKETS[1]}, job_timeout=t) for t in (-358, 5_000_000_000)]
    hostile = {}
    for name, args, kwargs in (("null args", None, {}), ("number args", 5, {}), ("list kwargs", [], ["ticket"])):
        job = q.enqueue("worker.rq_jobs.classify", {"text": "hello"})
        h.conn.hset(
            job.key, "data", zlib.compress(json.dumps(["worker.rq_jobs.classify", None, args, kwargs]).encode())
        )
        hostile[name] = job
    h.jobs += good + odd + list(hostile.values())

    _run_to_exit(h)

    _assert_labelled(h, good + odd)
    reasons = {"null args": "args must be an array, got null", "number args": "args must be an array, got number"}
    reasons["list kwargs"] = "kwargs must be an object, got array"
    for name, job in hostile.items():
        job = Job.fetch(job.id, connection=h.conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FAILED and reasons[name] in job.latest_result().exc_string, name
    assert h.conn.llen(f"rq:intermediate:{q.name}") == 0


def test_a_job_canceled_or_deleted_while_its_batch_fills_is_not_run(rq_setup):
    """A job waits for its batch in the intermediate list, out of the queue, where RQ's ``cancel`` and ``delete`` do
    not reach: the canceled job ran (a Result, a results-stream record, still in the canceled registry) and the
    deleted one's hash was written back whole. The batch is held open by its size (5, four queued) until the test
    has canceled and deleted, then filled by a fifth job: no race with the fill's wait."""
    h, q = rq_setup, rq_setup.queue
    jobs = [q.enqueue("worker.rq_jobs.classify", {"text": TICKETS[i]}) for i in range(4)]
    h.jobs += jobs
    canceled, deleted = jobs[0], jobs[1]
    with _running(h, "--burst", TRIAGE_WINDOW_MAX_ITEMS="5", TRIAGE_MAX_WAIT_MS="30000") as proc:
        _wait_for(lambda: h.conn.llen(q.intermediate_queue_key) == 4, "the batch filling", proc, h)
        canceled.cancel()
        deleted.delete()
        last = q.enqueue("worker.rq_jobs.classify", {"text": TICKETS[4]})
        h.jobs.append(last)
        assert proc.wait(timeout=120) == 0, h.log.read_text()
    _assert_labelled(h, [*jobs[2:], last])
    job = Job.fetch(canceled.id, connection=h.conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.CANCELED and job.latest_result() is None
    assert not h.conn.exists(deleted.key)
    mirrored = {f[b"id"].decode() for _, f in h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])}
    assert mirrored == {j.id for j in (*jobs[2:], last)}
    assert {e["job_id"]: e["status"] for e in _log_events(h, "rq_job_left_before_start")} == {
        canceled.id: "canceled",
        deleted.id: "deleted",
    }
    assert h.conn.llen(q.intermediate_queue_key) == 0
