"""What the worker's host side costs per ticket, stage by stage, without the forward pass (docs/benchmark.md,
"Host side").

    python scripts/host_costs.py [--model bundled:smollm2] [--n 2048] [--reps 5] [--json out.json]

At GPU speed the forward pass takes a few hundred microseconds per ticket at most, and every other
stage (read, parse, tokenize, plan, build the packed stream, softmax, result records, the settle
write) runs on the worker's threads in the same interpreter: the reader, the pass thread and the writer
share one interpreter lock. So their **thread CPU time** (``time.thread_time``: the calling thread only,
so the tokenizer's pool, which runs outside the lock, and Redis's own time do not count) is the host's
demand per ticket, and 1e6 / its sum the most tickets per second this host can feed a device whatever
its speed. Each stage is the worker's own function on a real window: tickets from
``producer.synth`` in a real Redis (a private server if none answers), the classifier from
``worker.assemble.build_classifier`` with the CUDA pass caps, packed passes; random label scores stand in
for the forward (what is measured does not depend on their values). Keys live under a fresh
``triage-hostcosts:<hex>:`` namespace and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (key, what it is, runs on)
STAGES = (
    ("read", "the window's read script (read_scripts.READ_NEW), reply parsed", "reader"),
    ("window", "parse entries + tokenize + frame (build_window)", "reader"),
    ("plan", "packed passes planned (Classifier.plan)", "reader"),
    ("stream", "each pass's packed token stream on the host (stream_tensors)", "pass"),
    ("postprocess", "softmax, threshold, Prediction objects", "pass"),
    ("records", "result records (pass_outcome)", "pass"),
    ("write", "settle script: arguments packed, results + keys + XACK (ResultSink.write)", "writer"),
)


def measure(settings, n: int, reps: int, redis_url: str) -> dict:
    """Best (lowest) wall and thread-CPU milliseconds of every stage over ``reps`` windows of ``n`` tickets."""
    import numpy as np
    import redis
    import torch

    from producer.synth import generate_tickets
    from worker.assemble import GPU_PASS_DEFAULTS, build_classifier
    from worker.engine.packed import Layout, stream_tensors
    from worker.keyspace import delete_under
    from worker.stream.sink import ResultSink
    from worker.stream.source import StreamSource
    from worker.stream.window import build_window, pass_outcome

    clf = build_classifier(settings)
    client = redis.Redis.from_url(redis_url)
    ns = f"triage-hostcosts:{uuid.uuid4().hex[:10]}:"
    stream = ns + "tickets"
    pipe = client.pipeline(transaction=False)
    for t in generate_tickets(n, seed=1):
        pipe.xadd(stream, {"id": t["id"], "text": t["text"]})
    pipe.execute()
    sink_kw = dict(
        input_stream=stream,
        results_stream=ns + "results",
        dead_letter_stream=ns + "dead",
        result_key_prefix=ns + "result:",
        result_ttl_s=600,
        results_maxlen=10 * n,
        dead_letter_maxlen=1000,
    )
    rng = np.random.default_rng(0)
    best: dict[str, list[float]] = {k: [float("inf"), float("inf")] for k, _, _ in STAGES}

    def one_window(rep: int) -> tuple[dict[str, list[float]], int, int]:
        """Every stage once over a fresh group's window: (wall ms, thread CPU ms) per stage, its tokens, its passes."""
        group, consumer = f"g{rep}", "host-costs"
        client.xgroup_create(stream, group, id="0")
        source = StreamSource(client, stream, group, consumer)
        sink = ResultSink(client, group=group, consumer=consumer, **sink_kw)
        got: dict[str, list[float]] = {k: [0.0, 0.0] for k, _, _ in STAGES}

        def timed(key, fn, *args, **kw):
            w0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args, **kw)
            got[key][0] += (time.perf_counter() - w0) * 1000
            got[key][1] += (time.thread_time() - c0) * 1000
            return out

        entries = timed("read", source.read_new, n, None)
        w = timed(
            "window",
            build_window,
            entries,
            "new",
            clf.prepare,
            max_text_bytes=settings.max_text_bytes,
            max_deliveries=10,
        )
        plan = timed("plan", clf.plan, w.prepared)
        for b in plan:
            chunk = [w.prepared[i] for i in b.indices]
            rows = [p.ids for p in chunk]
            timed("stream", stream_tensors, rows, Layout.build([len(r) for r in rows]), clf.prefix_length, clf.pad_id)
            preds = timed("postprocess", clf.postprocess, rng.normal(size=(len(chunk), len(clf.labels))), chunk)
            out, _ = timed("records", pass_outcome, w, b.indices, preds, model=clf.model_name, worker=consumer)
            timed("write", sink.write, out)
        pending = client.xpending(stream, group)["pending"]
        if pending or client.xlen(ns + "results") != n * (rep + 1):
            raise RuntimeError(f"the writes did not settle the window: {pending} entries still pending")
        return got, sum(len(p.ids) for p in w.prepared), len(plan)

    try:
        for rep in range(reps):
            got, tokens, passes = one_window(rep)
            for k, (wall, cpu) in got.items():
                best[k] = [min(best[k][0], wall), min(best[k][1], cpu)]
    finally:
        delete_under(client, ns)
    caps = {k: getattr(clf.options, k) for k in ("pass_max_items", "pass_max_tokens")}
    return {
        "namespace": ns,
        "n": n,
        "reps": reps,
        "text_and_cue_tokens_per_ticket": tokens / n,
        "labels": len(clf.labels),
        "passes": passes,
        "caps": caps,
        "cuda_defaults": {k: GPU_PASS_DEFAULTS[k] for k in caps},
        "torch": torch.__version__,
        "stages": {
            k: {"what": what, "thread": thread, "wall_ms": best[k][0], "thread_cpu_ms": best[k][1]}
            for k, what, thread in STAGES
        },
    }


def report(res: dict) -> str:
    n = res["n"]
    lines = [
        f"{n} tickets per window, {res['passes']} packed passes (caps {res['caps']['pass_max_items']} items / "
        f"{res['caps']['pass_max_tokens']} tokens), {res['text_and_cue_tokens_per_ticket']:.0f} tokens per ticket, "
        f"{res['labels']} labels; best of {res['reps']} windows",
        f"{'stage':12} {'thread':7} {'wall us/ticket':>15} {'CPU us/ticket':>14}  what",
    ]
    cpu = 0.0
    for k, s in res["stages"].items():
        cpu += s["thread_cpu_ms"]
        lines.append(
            f"{k:12} {s['thread']:7} {s['wall_ms'] * 1000 / n:15.1f} {s['thread_cpu_ms'] * 1000 / n:14.1f}  {s['what']}"
        )
    per = cpu * 1000 / n
    lines.append(
        f"host CPU per ticket (the worker's threads, one interpreter lock): {per:.1f} us -> at most "
        f"{1e6 / per:,.0f} tickets/s on this host, whatever the device"
    )
    res["cpu_us_per_ticket"], res["max_tickets_per_s"] = per, 1e6 / per
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("TRIAGE_MODEL", "bundled:smollm2"))
    p.add_argument("--n", type=int, default=2048, help="tickets per window (default 2048: one CUDA pass cap)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--redis-url", default=None, help="default TRIAGE_REDIS_URL; a private server if none answers")
    p.add_argument("--json")
    args = p.parse_args()

    from worker.assemble import GPU_PASS_DEFAULTS
    from worker.redis_server import RedisRefused, redis_or_private
    from worker.settings import Settings

    caps = {k: GPU_PASS_DEFAULTS[k] for k in ("pass_max_items", "pass_max_tokens", "pass_overhead_tokens")}
    settings = Settings(model=args.model, device="cpu", dtype="fp32", attention="packed", **caps)
    try:
        with redis_or_private(args.redis_url or settings.redis_url, log=lambda m: print(m, file=sys.stderr)) as url:
            res = measure(settings, args.n, args.reps, url)
    except RedisRefused as e:  # a Redis that refuses the URL's credentials: not replaced by a private one
        print(f"host_costs: {e}", file=sys.stderr)
        return 2
    print(report(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
