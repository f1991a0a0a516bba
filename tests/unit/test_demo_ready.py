"""The demo's latencies count from when the worker was ready, by the worker's own log stamp: it took the time its
reader thread got to the ``worker_ready`` line, and a thread that ran late (a loaded box) made most latencies
negative, as tickets were already being classified."""

from __future__ import annotations

import json
from types import SimpleNamespace

from producer.demo import WorkerProcess


def test_ready_is_the_worker_ready_lines_own_timestamp_not_when_it_was_read():
    lines = [
        "not json: kept as text\n",
        json.dumps({"event": "model_loaded", "timestamp": "2026-12-05T10:00:00.000000Z"}) + "\n",
        json.dumps({"event": "worker_ready", "timestamp": "2026-12-05T10:00:01.250000Z"}) + "\n",
    ]
    w = object.__new__(WorkerProcess)  # its reader alone, on lines as the subprocess writes them
    w.events, w.other_lines, w.ready_ms = [], [], None
    w.proc = SimpleNamespace(stdout=iter(lines))
    w._read()
    assert w.ready_ms == 1_796_464_801_250  # 2026-12-05 10:00:01.25 UTC
    assert [e["event"] for e in w.events] == ["model_loaded", "worker_ready"] and len(w.other_lines) == 1
