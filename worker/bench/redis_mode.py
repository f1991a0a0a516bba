"""Mode 6: the same tickets through Redis and the worker's own process (``python -m worker run --drain``).

Kept apart from the in-process modes: it needs Redis and a subprocess, they need neither.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from worker.keyspace import delete_under
from worker.logs import event_ms


def mode6(
    settings, texts: Sequence[str], dtype_name: str, first_runs, runs: list[dict], prefix_cache: bool | None = None
) -> dict:
    """Mode 6 as the bench reports it: ``run_redis`` on the settings' Redis (a private server where none answers:
    a GPU box has none), compared with the few-shot mode 5 of ``runs``; ``{"error": ...}`` where the Redis there
    refuses the URL's credentials (not measured against another Redis). ``prefix_cache``: the bench classifier's
    (``use_prefix_cache``), what the worker's own classifier, built the same way, runs."""
    import sys

    from worker.redis_server import RedisRefused, redis_or_private

    try:
        with redis_or_private(settings.redis_url, log=lambda m: print(m, flush=True), purpose="mode 6") as url:
            red = run_redis(
                settings.model_copy(update={"redis_url": url}), texts, dtype_name, first_runs, prefix_cache=prefix_cache
            )
    except RedisRefused as e:  # the other modes' figures stand
        print(f"triage-bench: mode 6 not run: {e}", file=sys.stderr, flush=True)
        return {"error": str(e)}
    m5 = next((m for r in runs if r["prompt"] == "few-shot" for m in r["modes"] if m["key"] == "bucketed_cached"), None)
    if m5 and red.get("items_per_s"):
        red["vs_mode5"] = red["items_per_s"] / m5["items_per_s"]
        if red.get("items_per_s_without_captures"):
            red["vs_mode5_without_captures"] = red["items_per_s_without_captures"] / m5["items_per_s"]
    return red


def run_redis(
    settings,
    texts: Sequence[str],
    dtype_name: str,
    refs: dict,
    timeout_s: float = 900.0,
    namespace: str | None = None,
    prefix_cache: bool | None = None,
) -> dict:
    """Mode 6: enqueue the tickets, run ``python -m worker run --drain`` as a subprocess, read the results.

    Keys live under ``namespace`` (default: a fresh ``triage-bench:<hex>:``) and
    are deleted at the end. Throughput counts from the worker's ``worker_ready`` log line (model
    loaded and warmed up) to the last result's ``classified_at_ms``, so it
    compares with mode 5's in-process wall time; the process wall time (model
    load included) is reported too. ``refs``: name -> ModeRun to compare labels with; ``prefix_cache``: whether
    the worker's classifier runs the cache (default: TRIAGE_PREFIX_CACHE, which a model may refuse).
    """
    import json
    import subprocess
    import sys
    import uuid

    import redis

    ns = namespace or f"triage-bench:{uuid.uuid4().hex[:10]}:"
    env = redis_worker_env(settings, ns, dtype_name)
    client = redis.Redis.from_url(settings.redis_url)
    out: dict = {
        "namespace": ns,
        "items": len(texts),
        "window_target_s": settings.window_target_s,
        # the worker's classifier's: mode 5 runs the same (vs_mode5)
        "prefix_cache": settings.prefix_cache if prefix_cache is None else prefix_cache,
    }
    try:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i, text in enumerate(texts):
            pipe.xadd(ns + "tickets", {"id": f"t{i}", "text": text})
        pipe.execute()
        out["enqueue_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "worker", "run", "--drain"]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out["error"] = f"the worker did not drain {len(texts)} tickets within {timeout_s:.0f}s"
            return out
        out["process_s"] = time.perf_counter() - t0
        out["exit_code"] = proc.returncode
        events = log_events(proc.stderr + "\n" + proc.stdout)
        results = {_s(f[b"id"]): f for _, f in client.xrange(ns + "results")}
        out["results"] = len(results)
        out["dead_lettered"] = client.xlen(ns + "dead")
        if proc.returncode != 0 or len(results) != len(texts):
            out["error"] = (
                f"worker exited {proc.returncode} with {len(results)}/{len(texts)} results: " + proc.stderr[-800:]
            )
            return out
        ready = next((e for e in events if e.get("event") == "worker_ready"), {})
        ready_ms = event_ms(ready)
        if ready_ms is None:
            out["error"] = "the worker never logged 'worker_ready' (TRIAGE_LOG_FORMAT=json expected on stderr)"
            return out
        n_captures, capture_s = graph_captures(events, ready_ms)
        out["redis_parser"] = ready.get("redis_parser")
        loaded = next((e for e in events if e.get("event") == "model_loaded"), {})
        out["cuda_graphs_start_up"] = loaded.get("cuda_graphs_warm_up")  # full-pass shapes, before worker_ready
        out["pass_overhead_tokens"] = loaded.get("pass_overhead_tokens")  # the worker's own ("auto": its measurement)
        done_ms = [int(_s(results[f"t{i}"][b"classified_at_ms"])) - ready_ms for i in range(len(texts))]
        batches = [e for e in events if e.get("event") == "window"]  # the worker logs one line per window
        wall_s = max(done_ms) / 1000.0
        infer_s = _seconds(batches, "infer_ms")
        gpu_s = _seconds(batches, "gpu_ms") if any(e.get("gpu_ms") is not None for e in batches) else None
        out.update(
            wall_s=wall_s,
            items_per_s=len(texts) / wall_s if wall_s > 0 else None,
            worker_windows=len(batches),
            window_items=[e.get("items", 0) + e.get("dead_lettered", 0) for e in batches],  # the ramp, then full
            windows_first_pass_early=sum(bool(e.get("first_pass_early")) for e in batches),  # lookahead across them
            infer_s=infer_s,
            tokenize_s=_seconds(batches, "tokenize_ms"),
            write_s=_seconds(batches, "write_ms"),
            read_s=_seconds(batches, "read_ms"),
            queue_overhead_pct=100.0 * (wall_s - infer_s) / wall_s if wall_s > 0 else None,
            gpu_s=gpu_s,  # CUDA: the passes' device time; mode 5's clocks say the same of it (gpu_busy_pct)
            gpu_busy_pct=100.0 * gpu_s / wall_s if gpu_s is not None and wall_s > 0 else None,
            # read + tokenize before the first pass: nothing to overlap it with yet
            first_window_s=_seconds(batches[:1], "read_ms", "tokenize_ms") if batches else None,
            first_result_s=min(done_ms) / 1000.0,  # worker_ready to the first result: the ramp's latency effect
            done_s_p50=sorted(done_ms)[len(done_ms) // 2] / 1000.0,
            done_s_max=max(done_ms) / 1000.0,
            cuda_graph_captures=n_captures,
            cuda_graph_capture_s=capture_s,
        )
        rest_s = wall_s - capture_s  # mode 5 is timed after its captures (modes.warm_up)
        out["items_per_s_without_captures"] = len(texts) / rest_s if n_captures and rest_s > 0 else None
        labels = [_s(results[f"t{i}"][b"label"]) for i in range(len(texts))]
        scores = [json.loads(_s(results[f"t{i}"][b"scores"])) for i in range(len(texts))]
        out["agreement"] = {}
        for name, ref in refs.items():
            pairs = [(a, s, p) for a, s, p in zip(labels, scores, ref.preds) if p is not None]  # subsampled mode 1
            same = sum(a == p.label for a, _, p in pairs)
            dp = max((abs(s[k] - p.scores[k]) for _, s, p in pairs for k in p.scores), default=None)
            out["agreement"][name] = {
                "label_agreement": same / len(pairs) if pairs else None,
                "max_abs_dprob": dp,
                "tickets": len(pairs),
            }
        return out
    finally:
        delete_under(client, ns)


def redis_namespace(settings, ns: str, dtype_name: str):
    """``settings`` with the bench's keys under ``ns`` (and the dtype the bench resolved): what mode 6's worker runs."""
    return settings.model_copy(
        update={
            "input_stream": ns + "tickets",
            "results_stream": ns + "results",
            "dead_letter_stream": ns + "dead",
            "result_key_prefix": ns + "result:",
            "heartbeat_key_prefix": ns + "heartbeat:",
            "group": "bench",
            "consumer": "bench-worker",
            "dtype": dtype_name,
            "log_format": "json",
            "log_level": "INFO",
        }
    )


def redis_worker_env(settings, ns: str, dtype_name: str) -> dict[str, str]:
    """The worker subprocess's environment: this process's, every ``TRIAGE_*`` replaced by the bench's settings."""
    import os

    import torch

    from worker.settings import settings_to_env

    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRIAGE_")}
    env.update(settings_to_env(redis_namespace(settings, ns, dtype_name)))
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # the worker gets the bench's thread count
    return env


def _seconds(events: list[dict], *keys: str) -> float:
    """The ``keys`` (milliseconds) of ``events`` summed, in seconds (a missing field counts 0)."""
    return sum(e.get(k) or 0 for e in events for k in keys) / 1000.0


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def log_events(text: str) -> list[dict]:
    """The JSON log lines of a worker's output (``TRIAGE_LOG_FORMAT=json``), as dicts; other lines are skipped."""
    import json

    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def graph_captures(events: list[dict], after_ms: int) -> tuple[int, float]:
    """CUDA graphs the worker captured after ``after_ms`` (its ``worker_ready``): how many, and their seconds.

    Each capture is logged once (``engine/graphs.py``); a long-running worker pays them once per shape."""
    from worker.engine.graphs import CAPTURED_EVENT

    late = [e for e in events if e.get("event") == CAPTURED_EVENT and (event_ms(e) or 0) > after_ms]
    return len(late), sum(e.get("capture_ms") or 0 for e in late) / 1000.0
