"""``triage-producer demo`` / ``make demo``: the whole job end to end, then a summary.

A Redis (the configured one if it answers, else a private ``redis-server``), a
unique key namespace (nobody else's data is touched; deleted afterwards unless
``--keep``), a few hundred synthetic long-tailed tickets plus three deliberately
bad ones, the real worker as a subprocess (``python -m worker run --drain``,
default model, the caller's TRIAGE_* environment), a progress bar, and a
summary built from the results stream and the worker's JSON log lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import redis

from producer.client import TriageClient
from producer.local_redis import demo_redis
from producer.results import as_str
from producer.settings import ProducerSettings
from producer.synth import generate_tickets
from worker.engine.types import padding_pct, percentile
from worker.keyspace import delete_under, keys_under
from worker.logs import event_ms
from worker.wording import count_of

BAD_TICKETS = [  # each is dead-lettered by the worker, with a reason
    {"id": "bad-empty-text", "text": ""},
    {"id": "bad-whitespace-text", "text": "   \n\t  "},
    {"id": "bad-meta-not-json", "text": "Where is my order #12345?", "meta": "{this is not json"},
]


class WorkerProcess:
    """The worker subprocess; its stderr JSON lines are parsed as they come (non-JSON kept as text)."""

    def __init__(self, env: dict[str, str]):
        self.events: list[dict] = []
        self.other_lines: list[str] = []
        self.ready_ms: int | None = None  # when the worker was ready: its "worker_ready" line's own timestamp
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "run", "--drain"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            line = line.rstrip("\n")
            try:
                ev = json.loads(line)
            except ValueError:
                ev = None
            if isinstance(ev, dict) and "event" in ev:
                if ev["event"] == "worker_ready":  # by its stamp: this thread may read the line late
                    self.ready_ms = event_ms(ev)
                self.events.append(ev)
            elif line.strip():
                self.other_lines.append(line)

    def first(self, name: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def _worker_env(settings: ProducerSettings, ns: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TRIAGE_REDIS_URL=settings.redis_url,
        TRIAGE_INPUT_STREAM=settings.input_stream,
        TRIAGE_RESULTS_STREAM=settings.results_stream,
        TRIAGE_DEAD_LETTER_STREAM=settings.dead_letter_stream,
        TRIAGE_RESULT_KEY_PREFIX=settings.result_key_prefix,
        TRIAGE_HEARTBEAT_KEY_PREFIX=ns + "heartbeat:",
        TRIAGE_GROUP=settings.group,
        TRIAGE_LOG_FORMAT="json",
        TRIAGE_LOG_LEVEL="INFO",
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _watch(client: TriageClient, worker: WorkerProcess, total: int, timeout_s: float) -> bool:
    """Progress bar until the worker exits; False if it ran past ``timeout_s``."""
    from tqdm import tqdm

    s = client.settings
    deadline = time.monotonic() + timeout_s
    with tqdm(total=total, desc="classify", unit="ticket", file=sys.stderr, disable=None) as bar:
        bar.set_postfix_str("loading model")
        while worker.proc.poll() is None:
            if time.monotonic() > deadline:
                return False
            done = client.redis.xlen(s.results_stream) + client.redis.xlen(s.dead_letter_stream)
            bar.update(min(done, total) - bar.n)
            if worker.ready_ms is not None:
                bar.set_postfix_str("")
            time.sleep(0.25)
        done = client.redis.xlen(s.results_stream) + client.redis.xlen(s.dead_letter_stream)
        bar.update(min(done, total) - bar.n)
    return True


def summarize(client: TriageClient, worker: WorkerProcess, labels_by_id: dict[str, str], wall_s: float) -> dict:
    """The demo's numbers, from the results/dead-letter streams and the worker's "window" log lines."""
    s = client.settings
    results = [f for _, f in client.redis.xrange(s.results_stream)]
    dead = [f for _, f in client.redis.xrange(s.dead_letter_stream)]
    windows = [e for e in worker.events if e.get("event") == "window"]
    loaded = worker.first("model_loaded") or {}
    real = sum(int(b.get("real_tokens") or 0) for b in windows)
    padded = sum(int(b.get("padded_tokens") or 0) for b in windows)
    busy_ms = sum(float(b.get(k) or 0) for b in windows for k in ("tokenize_ms", "infer_ms", "write_ms"))
    done_at = [int(f["classified_at_ms"]) for f in results if f.get("classified_at_ms")]
    ready_ms = worker.ready_ms
    # Tickets were all queued before the worker started:
    # count their wait from when it was ready, not from model loading.
    latencies = []
    for f in results:
        if "stream_id" in f and "classified_at_ms" in f:
            enq = int(f["stream_id"].split("-")[0])
            latencies.append(int(f["classified_at_ms"]) - max(enq, ready_ms or enq))
    agree = [labels_by_id[f["id"]] == f.get("label") for f in results if f.get("id") in labels_by_id]
    span_s = (max(done_at) - ready_ms) / 1000 if done_at and ready_ms and max(done_at) > ready_ms else None
    return {
        "classified": len(results),
        "dead_lettered": len(dead),
        "dead_letter_reasons": Counter(f.get("reason", "?") for f in dead),
        "labels": Counter(f.get("label", "?") for f in results),
        "agreement_with_intended_label": sum(agree) / len(agree) if agree else None,
        "windows": len(windows),
        "passes": sum(int(b.get("passes") or 0) for b in windows),
        "padding_pct": padding_pct(real, padded) if padded else None,
        "items_per_s_busy": 1000.0 * (len(results) + len(dead)) / busy_ms if busy_ms else None,
        "items_per_s_wall": len(results) / span_s if span_s else None,
        "latency_p50_ms": percentile(latencies, 50),
        "latency_p99_ms": percentile(latencies, 99),
        "model": loaded.get("model") or (results[0].get("model") if results else None),
        "device": loaded.get("device"),
        "dtype": loaded.get("dtype"),
        "model_load_ms": loaded.get("load_ms"),
        "wall_s": wall_s,
    }


def _fmt(v, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def render(sm: dict, n_bad: int) -> str:
    total = sm["classified"] or 1
    agreement = sm["agreement_with_intended_label"]
    agreement_pct = None if agreement is None else 100 * agreement
    lines = [
        "",
        "=== triage demo summary ===",
        f"model           {sm['model']}  on {sm['device']} / {sm['dtype']}  "
        f"(loaded in {_fmt(sm['model_load_ms'], '.0f', ' ms')})",
        f"classified      {count_of(sm['classified'], 'ticket')} in {count_of(sm['windows'], 'window')} "
        f"({count_of(sm['passes'], 'forward pass', 'forward passes')})",
        "labels          " + ", ".join(f"{k} {v} ({100 * v / total:.0f}%)" for k, v in sm["labels"].most_common()),
        f"agreement       {_fmt(agreement_pct, '.0f', '%')} with the generator's intended label",
        f"throughput      {_fmt(sm['items_per_s_wall'])} items/s wall (worker ready -> last result), "
        f"{_fmt(sm['items_per_s_busy'])} items/s busy (tokenize+infer+write)",
        f"padding         {_fmt(sm['padding_pct'], '.1f', '%')} of computed tokens (length-bucketed passes)",
        f"latency         p50 {_fmt(sm['latency_p50_ms'], '.0f', ' ms')}, "
        f"p99 {_fmt(sm['latency_p99_ms'], '.0f', ' ms')}"
        " (enqueue or worker-ready -> result; all tickets were queued up front)",
        f"dead-lettered   {sm['dead_lettered']} (of {n_bad} deliberately bad tickets)",
    ]
    lines += [f"                - {count}x {reason}" for reason, count in sm["dead_letter_reasons"].most_common()]
    lines.append(f"total wall time {sm['wall_s']:.1f} s")
    return "\n".join(lines)


def _cleanup(client: TriageClient, ns: str) -> int:
    return delete_under(client.redis, ns)


def run_demo(
    *,
    n: int = 300,
    seed: int = 0,
    keep: bool = False,
    redis_url: str | None = None,
    namespace: str | None = None,
    timeout_s: float = 900.0,
    json_out: str | None = None,
) -> int:
    from worker.redact import mask_secrets

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress chatter on stderr, summary on stdout
    base = ProducerSettings()
    ns = namespace or f"triage-demo:{uuid.uuid4().hex[:8]}:"
    t0 = time.monotonic()
    try:
        with demo_redis(redis_url, base.redis_url, log=say) as url:
            settings = base.model_copy(
                update=dict(
                    redis_url=url,
                    input_stream=ns + "tickets",
                    results_stream=ns + "results",
                    dead_letter_stream=ns + "dead",
                    result_key_prefix=ns + "result:",
                    input_max_backlog=0,
                )
            )
            client = TriageClient(settings)
            say(f"redis {mask_secrets(url)}, namespace {ns!r}")
            taken = next(keys_under(client.redis, ns), None)
            if taken is not None:  # the demo deletes everything under its namespace at the end
                say(
                    f"triage-producer demo: namespace {ns!r} already holds keys (e.g. {as_str(taken)!r}); the demo "
                    "needs an empty one and deletes everything under it at the end: choose another --namespace"
                )
                return 2
            try:
                return _run(client, settings, ns, n, seed, timeout_s, json_out, t0, say)
            finally:
                if keep:
                    say(f"kept keys under {ns!r}")
                else:
                    say(f"cleaned up {_cleanup(client, ns)} keys under {ns!r}")
    except (RuntimeError, redis.ConnectionError) as e:
        say(f"triage-producer demo: {e}")
        return 1


def _run(
    client: TriageClient, settings: ProducerSettings, ns: str, n: int, seed: int, timeout_s: float, json_out, t0, say
) -> int:
    from tqdm import tqdm

    synthetic = generate_tickets(n, seed=seed)
    tickets: list[dict] = [{"id": t["id"], "text": t["text"]} for t in synthetic]
    for k, bad in enumerate(BAD_TICKETS):  # spread through the stream, not all at the end
        tickets.insert((k + 1) * len(tickets) // (len(BAD_TICKETS) + 1), bad)
    with tqdm(total=len(tickets), desc="enqueue", unit="ticket", file=sys.stderr, disable=None) as bar:
        client.submit_many(tickets, on_progress=bar.update)
    model = os.environ.get("TRIAGE_MODEL", "bundled:smollm2")
    say(f"enqueued {len(tickets)} tickets; starting worker (python -m worker run --drain, model {model})")
    worker = WorkerProcess(_worker_env(settings, ns))
    try:
        finished = _watch(client, worker, len(tickets), timeout_s)
    finally:
        worker.stop()
    if not finished or worker.proc.returncode != 0:
        why = f"ran past --timeout-s {timeout_s}" if not finished else f"exited with code {worker.proc.returncode}"
        say(f"worker {why}; last output:")
        for line in (worker.other_lines + [json.dumps(e) for e in worker.events[-8:]])[-15:]:
            say("  " + line)
        return 1
    sm = summarize(client, worker, {t["id"]: t["label"] for t in synthetic}, time.monotonic() - t0)
    print(render(sm, len(BAD_TICKETS)), flush=True)
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(sm, f, indent=2, default=str)
    return 0
