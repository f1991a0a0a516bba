"""Two workers drain one backlog: how the tickets split between them and how long the drain takes, with
fixed windows (TRIAGE_WINDOW_TARGET_S=0) and windows sized by measured work (the default).

    .venv/bin/python scripts/share_backlog.py --n 400 --targets 0,5,2   # the bundled model, one thread each

Uses the Redis at TRIAGE_REDIS_URL (default 127.0.0.1:6379) under a fresh key prefix, deleted afterwards.
The model and everything else come from the caller's TRIAGE_* environment, as for the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.synth import generate_tickets  # noqa: E402
from worker.bench.redis_mode import log_events, redis_worker_env  # noqa: E402
from worker.keyspace import delete_under  # noqa: E402
from worker.redact import MaskingArgumentParser, install_excepthook, register_env_secrets  # noqa: E402
from worker.settings import Settings  # noqa: E402


def drain_with_two_workers(url: str, n: int, target_s: str) -> dict:
    """Push ``n`` tickets, start two ``run --drain`` workers at once, wait for both; who did what, how long."""
    ns = f"triage-share:{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(url, decode_responses=True)
    for t in generate_tickets(n, seed=7):
        r.xadd(ns + "tickets", {"id": t["id"], "text": t["text"]})
    # the bench's Redis-mode environment (the caller's TRIAGE_* settings, the keys under ns), one torch thread each
    settings = Settings(redis_url=url).model_copy(update={"window_target_s": float(target_s), "torch_threads": 1})
    env = redis_worker_env(settings, ns, settings.dtype)
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "worker", "run", "--drain", "--consumer", name],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("worker-a", "worker-b")
    ]
    logs = [p.communicate()[1] for p in procs]
    wall_s = time.monotonic() - t0
    by_worker = Counter(f.get("worker") for _, f in r.xrange(ns + "results"))
    windows = {
        name: [e for e in log_events(log) if e.get("event") == "window"]
        for name, log in zip(("worker-a", "worker-b"), logs)
    }
    delete_under(r, ns)
    return {
        "target_s": float(target_s),
        "wall_s": round(wall_s, 1),
        "results": dict(sorted(by_worker.items())),
        "windows": {k: [w["items"] for w in v] for k, v in windows.items()},
        "exit_codes": [p.returncode for p in procs],
    }


def main() -> int:
    # a password in the URL or the environment never reaches a usage error, a traceback or a worker's log excerpt
    register_env_secrets()
    install_excepthook()
    p = MaskingArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=120)
    p.add_argument("--targets", default="0,5", help="TRIAGE_WINDOW_TARGET_S values to compare (0: fixed windows)")
    p.add_argument("--redis-url", default=os.environ.get("TRIAGE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = p.parse_args()
    for target in args.targets.split(","):
        print(json.dumps(drain_with_two_workers(args.redis_url, args.n, target)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
