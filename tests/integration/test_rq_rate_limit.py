"""RQ 3's job rate limits (``RateLimit``) through the batch worker when Redis fails right after a job's success was
written: recorded once, its slot freed once. Real Redis (a private server: rate limits are global RQ keys), the
recording steps in this process (no model)."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.job import JobStatus
from rq.rate_limit import RateLimit, RateLimitRegistry
from rq.serializers import JSONSerializer

from tests.integration import test_rq
from tests.integration.test_rq import TICKETS
from tests.integration.test_rq_faults import _classified, _fetch, _in_process, _private_server, _started, _succeed
from tests.tcp_proxy import TcpProxy

rq_setup = test_rq.rq_setup


@pytest.mark.parametrize("after", [False, True], ids=["release-not-sent", "release-reply-lost"])
def test_a_rate_limited_job_whose_slot_release_fails_after_its_success_is_recorded_once(rq_setup, after):
    """RQ's handle_job_success frees the slot (release_slot, a script) after its MULTI/EXEC: a connection lost there
    raised out of it with the success applied. The next try must see it applied (the worker's landing token) and only
    free the slot, once: not a second Result, results-stream entry and success count."""
    with _private_server(rq_setup) as h:
        kw = h.conn.connection_pool.connection_kwargs
        with TcpProxy(kw["host"], kw["port"]) as proxy:
            conn = redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0))  # redis-py's own retries used up
            queue = Queue(h.queue.name, connection=conn, serializer=JSONSerializer)
            limit = RateLimit("faults-limit", concurrency=1)
            running, waiting = (queue.enqueue("worker.rq_jobs.classify", t, rate_limit=limit) for t in TICKETS[:2])
            assert _fetch(h, waiting).get_status() == JobStatus.RATE_LIMITED
            worker = _in_process(conn, [queue.name], h.worker_name)
            entries = _started(worker, [running])
            _classified(entries)
            proxy.drop_at(b"EVALSHA", after=after)  # the first script after the success: RQ's release_slot
            _succeed(worker, entries, h.env["TRIAGE_RESULTS_STREAM"])
            assert proxy.triggered.wait(10)
        done = _fetch(h, running)
        assert done.get_status() == JobStatus.FINISHED and len(done.results()) == 1
        assert [f[b"id"].decode() for _, f in h.conn.xrange(h.env["TRIAGE_RESULTS_STREAM"])] == [running.id]
        assert int(h.conn.hget(worker.key, "successful_job_count")) == 1
        registry = RateLimitRegistry("faults-limit", h.conn)
        assert registry.get_allowed_job_ids() == [waiting.id] and registry.get_rate_limited_job_ids() == []
        assert h.queue.get_job_ids() == [waiting.id]  # the waiting job, promoted once
