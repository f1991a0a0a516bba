"""Measure classify throughput at several torch intra-op thread counts, interleaved (docs/benchmark.md, "Threads").

    python scripts/threads_probe.py --model bundled:smollm2 --threads 0,1,2 --n 32 --reps 3 [--json out.json]

Run one copy for "one worker on the host", several copies at once for "workers sharing the host".
Each rep runs every thread count once on the same prepared tickets (interleaved, so drift in the
machine's load hits every setting alike); prints items/s per setting (median of reps) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", default="0,1,2")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()

    import torch

    from worker.assemble import build_classifier
    from worker.settings import Settings

    default_threads = torch.get_num_threads()
    settings = Settings(model=args.model, dtype=args.dtype, device="cpu", torch_threads=0)
    clf = build_classifier(settings)
    rows = [
        json.loads(line) for line in (REPO / "tests/data/long_tail_tickets.jsonl").read_text().splitlines()[: args.n]
    ]
    items = clf.prepare_valid([r["text"] for r in rows])
    clf.classify(items[:4])  # warm-up
    counts = [int(x) for x in args.threads.split(",")]
    times: dict[int, list[float]] = {c: [] for c in counts}
    for _ in range(args.reps):
        for c in counts:
            torch.set_num_threads(c or default_threads)
            t0 = time.perf_counter()
            clf.classify(items)
            times[c].append(time.perf_counter() - t0)
    out = {
        "model": args.model,
        "dtype": clf.dtype_name,
        "n": len(items),
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "torch_default_threads": default_threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "items_per_s": {str(c): round(len(items) / statistics.median(ts), 2) for c, ts in times.items()},
        "wall_s": {str(c): [round(t, 2) for t in ts] for c, ts in times.items()},
    }
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
