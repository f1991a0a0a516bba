"""The batching strategies the benchmark compares, each driving the same engine on the same tickets.

Every mode is a batch plan + (prefix cache on/off, pad-to width) handed to
``Classifier.classify`` one batch at a time, so the engine's own code path runs
and each batch's wall time is seen (progress bar, per-ticket latency).

Latency, as reported: ``batch_ms`` is the wall time of the forward pass that
produced a ticket's result (batch start -> batch end, shared by all its
tickets; for the sequential mode, the ticket's own pass). ``done_s`` is the
mode's own elapsed time (its batches only, in plan order) until that ticket's
result exists, as for a backlog that arrived all at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from worker.engine import bucketing


@dataclass(frozen=True)
class ModeSpec:
    key: str
    title: str
    cached: bool  # shared prefix KV cache on
    global_pad: bool = False  # pad every batch to the longest ticket of the whole set


MODES: dict[str, ModeSpec] = {
    "sequential": ModeSpec("sequential", "1 sequential (1/pass, no cache)", cached=False),
    "global_pad": ModeSpec("global_pad", "2 arrival, pad to global max", cached=False, global_pad=True),
    "arrival": ModeSpec("arrival", "3 arrival, pad to batch max", cached=False),
    "bucketed": ModeSpec("bucketed", "4 length buckets, no cache", cached=False),
    "bucketed_cached": ModeSpec("bucketed_cached", "5 length buckets + prefix cache", cached=True),
}
MODE_ORDER = tuple(MODES)


@dataclass
class ModeRun:
    key: str
    title: str
    cached: bool
    pad_to: int | None
    batches: list[bucketing.Batch]
    preds: list  # Prediction per ticket, input order
    batch_s: list[float] = field(default_factory=list)  # wall time per batch, plan order
    done_s: list[float] = field(default_factory=list)  # per ticket, input order
    item_batch_s: list[float] = field(default_factory=list)  # per ticket, input order
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (all threads): robust to other load on a shared machine
    real_tokens: int = 0  # cost tokens without padding (prefix included when not cached)
    computed_tokens: int = 0  # what the forward passes ran, padding included
    work_tokens: int = 0  # ticket suffix tokens only: the real work
    work_lengths: list[int] = field(default_factory=list)  # suffix tokens per ticket (text + answer cue)
    prefix_tokens_recomputed: int = 0


def plan(clf, items: Sequence, spec: ModeSpec, fixed_batch: int) -> tuple[list[bucketing.Batch], int | None]:
    """The batches (indices into ``items``; lengths = cost lengths) and the pad-to width for a mode."""
    lengths = [clf.cost_length(p, spec.cached) for p in items]
    if spec.key == "sequential":
        return [bucketing.Batch((i,), (n,)) for i, n in enumerate(lengths)], None
    if spec.key in ("global_pad", "arrival"):
        return bucketing.plan_arrival_order(lengths, fixed_batch), (max(lengths) if spec.global_pad else None)
    return bucketing.plan_batches(lengths, clf.max_batch_items, clf.max_batch_tokens), None


def run_modes(
    clf,
    items: Sequence,
    specs: Sequence[ModeSpec],
    fixed_batch: int,
    interleave: bool = True,
    on_batch: Callable[[int], None] = lambda n: None,
) -> dict[str, ModeRun]:
    """Run several modes over the same ``items``; ``on_batch(batch_size)`` after every forward pass.

    ``interleave``: always run the next batch of the mode that is least far through
    its planned (computed) tokens, so every mode meets the same load from other
    processes over the run instead of one mode drawing a quiet minute and another a
    busy one. Each mode's clocks (wall, CPU, ``done_s``) count only its own batches.
    """
    runs = {s.key: start(clf, items, s, *plan(clf, items, s, fixed_batch)) for s in specs}
    execute(clf, items, list(runs.values()), interleave, on_batch)
    return runs


def execute(
    clf, items: Sequence, runs: Sequence[ModeRun], interleave: bool = True, on_batch: Callable[[int], None] = lambda n: None
) -> None:
    """Run the planned batches of every run (see ``run_modes`` for the interleaving rule)."""
    todo = [list(r.batches) for r in runs]
    total = [max(1, sum(b.size * max(b.max_len, r.pad_to or 0) for b in r.batches)) for r in runs]
    spent = [0] * len(runs)
    while any(todo):
        live = [j for j in range(len(runs)) if todo[j]]
        j = min(live, key=lambda j: spent[j] / total[j]) if interleave else live[0]
        b = todo[j].pop(0)
        _step(clf, items, runs[j], b)
        spent[j] += b.size * max(b.max_len, runs[j].pad_to or 0)
        on_batch(b.size)


def run_mode(clf, items: Sequence, spec: ModeSpec, fixed_batch: int, on_batch: Callable[[int], None] = lambda n: None) -> ModeRun:
    return run_modes(clf, items, [spec], fixed_batch, on_batch=on_batch)[spec.key]


def start(clf, items: Sequence, spec: ModeSpec, batches: list[bucketing.Batch], pad_to: int | None) -> ModeRun:
    """A run of ``spec`` over ``items`` with its batches planned, nothing executed yet."""
    run = ModeRun(spec.key, spec.title, spec.cached, pad_to, batches, preds=[None] * len(items))
    run.done_s = [0.0] * len(items)
    run.item_batch_s = [0.0] * len(items)
    run.work_lengths = [len(p.ids) for p in items]
    run.work_tokens = sum(run.work_lengths)
    run.prefix_tokens_recomputed = 0 if spec.cached else clf.prefix_length * len(items)
    return run


def _step(clf, items: Sequence, run: ModeRun, b: bucketing.Batch) -> None:
    """One planned batch through ``Classifier.classify``, timed (wall and process CPU)."""
    chunk = [items[i] for i in b.indices]
    local = bucketing.Batch(tuple(range(len(chunk))), b.lengths)
    c0, t0 = time.process_time(), time.perf_counter()
    preds, stats = clf.classify(chunk, batches=[local], prefix_cache=run.cached, pad_to=run.pad_to)
    t1, c1 = time.perf_counter(), time.process_time()
    run.batch_s.append(t1 - t0)
    run.wall_s += t1 - t0
    run.cpu_s += c1 - c0
    for i, p in zip(b.indices, preds):
        run.preds[i] = p
        run.done_s[i] = run.wall_s
        run.item_batch_s[i] = t1 - t0
    run.real_tokens += stats.real_tokens
    run.computed_tokens += stats.padded_tokens


def warm_up(clf, items: Sequence) -> None:
    """A small cached and uncached pass: first-call allocations and kernel selection stay out of the timings."""
    clf.classify(list(items[:2]), prefix_cache=True)
    clf.classify(list(items[:1]), prefix_cache=False)


# ------------------------------------------------------------------ mode 6
def run_redis(settings, texts: Sequence[str], dtype_name: str, refs: dict, timeout_s: float = 900.0, namespace: str | None = None) -> dict:
    """Mode 6: enqueue the tickets, run ``python -m worker run --drain`` as a subprocess, read the results.

    Keys live under ``namespace`` (default: a fresh ``triage-bench:<hex>:``) and
    are deleted at the end. Throughput counts from the worker's ``worker_ready`` log line (model
    loaded and warmed up) to the last result's ``classified_at_ms``, so it
    compares with mode 5's in-process wall time; the process wall time (model
    load included) is reported too. ``refs``: name -> ModeRun to compare labels with.
    """
    import json
    import os
    import subprocess
    import sys
    import uuid

    import redis
    import torch

    ns = namespace or f"triage-bench:{uuid.uuid4().hex[:10]}:"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIAGE_")}
    env.update(
        TRIAGE_MODEL=settings.model, TRIAGE_DEVICE=settings.device, TRIAGE_DTYPE=dtype_name,
        TRIAGE_CACHE_DIR=str(settings.cache_dir), TRIAGE_REDIS_URL=settings.redis_url,
        TRIAGE_MAX_BATCH_ITEMS=str(settings.max_batch_items), TRIAGE_MAX_BATCH_TOKENS=str(settings.max_batch_tokens),
        TRIAGE_MAX_INPUT_TOKENS=str(settings.max_input_tokens), TRIAGE_INPUT_STREAM=ns + "tickets",
        TRIAGE_RESULTS_STREAM=ns + "results", TRIAGE_DEAD_LETTER_STREAM=ns + "dead", TRIAGE_RESULT_KEY_PREFIX=ns + "result:",
        TRIAGE_HEARTBEAT_KEY_PREFIX=ns + "heartbeat:", TRIAGE_GROUP="bench", TRIAGE_CONSUMER="bench-worker",
        TRIAGE_LOG_FORMAT="json", TRIAGE_LOG_LEVEL="INFO",
        OMP_NUM_THREADS=str(torch.get_num_threads()),  # the worker gets the bench's thread count
        TRIAGE_TORCH_THREADS=str(torch.get_num_threads()),
    )
    for key in ("task_file", "labels"):
        if getattr(settings, key):
            env[f"TRIAGE_{key.upper()}"] = str(getattr(settings, key))
    client = redis.Redis.from_url(settings.redis_url)
    out: dict = {"namespace": ns, "items": len(texts), "max_batch_items": settings.max_batch_items}
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
        events = [_json_line(line) for line in proc.stderr.splitlines() + proc.stdout.splitlines()]
        events = [e for e in events if e]
        results = {_s(f[b"id"]): f for _, f in client.xrange(ns + "results")}
        out["results"] = len(results)
        out["dead_lettered"] = client.xlen(ns + "dead")
        if proc.returncode != 0 or len(results) != len(texts):
            out["error"] = f"worker exited {proc.returncode} with {len(results)}/{len(texts)} results: " + proc.stderr[-800:]
            return out
        ready_ms = _event_ms(events, "worker_ready")
        if ready_ms is None:
            out["error"] = "the worker never logged 'worker_ready' (TRIAGE_LOG_FORMAT=json expected on stderr)"
            return out
        done_ms = [int(_s(results[f"t{i}"][b"classified_at_ms"])) - ready_ms for i in range(len(texts))]
        batches = [e for e in events if e.get("event") == "batch"]
        wall_s = max(done_ms) / 1000.0
        out.update(
            wall_s=wall_s,
            items_per_s=len(texts) / wall_s if wall_s > 0 else None,
            worker_batches=len(batches),
            infer_s=sum(b.get("infer_ms") or 0 for b in batches) / 1000.0,
            tokenize_s=sum(b.get("tokenize_ms") or 0 for b in batches) / 1000.0,
            write_s=sum(b.get("write_ms") or 0 for b in batches) / 1000.0,
            read_s=sum(b.get("read_ms") or 0 for b in batches) / 1000.0,
            queue_overhead_pct=100.0 * (wall_s - sum(b.get("infer_ms") or 0 for b in batches) / 1000.0) / wall_s if wall_s > 0 else None,
            done_s_p50=sorted(done_ms)[len(done_ms) // 2] / 1000.0,
            done_s_max=max(done_ms) / 1000.0,
        )
        labels = [_s(results[f"t{i}"][b"label"]) for i in range(len(texts))]
        scores = [json.loads(_s(results[f"t{i}"][b"scores"])) for i in range(len(texts))]
        out["agreement"] = {}
        for name, ref in refs.items():
            same = sum(a == p.label for a, p in zip(labels, ref.preds))
            dp = max(abs(s[k] - p.scores[k]) for s, p in zip(scores, ref.preds) for k in p.scores)
            out["agreement"][name] = {"label_agreement": same / len(texts), "max_abs_dprob": dp}
        return out
    finally:
        keys = list(client.scan_iter(match=ns + "*", count=1000))
        if keys:
            client.delete(*keys)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _json_line(line: str) -> dict | None:
    import json

    if not line.startswith("{"):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _event_ms(events: list[dict], name: str) -> int | None:
    import datetime as dt

    for e in events:
        if e.get("event") == name and e.get("timestamp"):
            return int(dt.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() * 1000)
    return None
