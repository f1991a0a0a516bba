"""``triage-bench --profile FILE``: mode 5's passes once more under torch.profiler, after the timed runs.

The timed figures never come from here (profiling slows every op); this says where the time of the same
passes goes when a target is missed, without another device session: ops by their own device time and
by their own host time, and how many kernel launches and graph replays the host issued per pass (the
first GPU diagnosis found 2.4 ms cuDNN plan builds per call and ~1,900 launches per pass this way).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

LAUNCH_OPS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_OPS = ("cudaGraphLaunch",)


def profile_passes(clf, items: Sequence, passes: Sequence, path: str, top: int = 25, max_passes: int = 24) -> dict:
    """Run up to ``max_passes`` of ``passes`` (spread over the plan: short to long tickets) through
    ``clf.classify_passes`` under the profiler; write the tables to ``path``. A failure is reported in the
    returned dict, never raised: the timed figures are already written."""
    try:
        return _profile(clf, items, list(passes)[:: max(1, -(-len(passes) // max_passes))], path, top)
    except Exception as e:  # noqa: BLE001 - a profiler problem must not cost the run its figures
        print(f"profile failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def _profile(clf, items: Sequence, passes: list, path: str, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = clf.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in clf.classify_passes(items, passes):
            pass
        if on_cuda:
            torch.cuda.synchronize()
    wall_s = time.perf_counter() - t0
    averages = prof.key_averages()
    counts = {e.key: e.count for e in averages}
    launches = sum(counts.get(k, 0) for k in LAUNCH_OPS)
    replays = sum(counts.get(k, 0) for k in GRAPH_OPS)
    n = max(1, len(passes))
    summary = {
        "path": path,
        "passes": len(passes),
        "items": sum(len(p.indices) for p in passes),
        "wall_s": round(wall_s, 3),
        "kernel_launches": launches,
        "graph_replays": replays,
        "launches_per_pass": round(launches / n, 1),
    }
    head = (
        f"mode 5 passes under torch.profiler (slower than the timed run; for where the time goes): "
        f"{summary['passes']} passes, {summary['items']} tickets, {wall_s:.2f}s wall; "
        f"{launches} kernel launches ({summary['launches_per_pass']} per pass), {replays} CUDA graph replays"
    )
    tables = [head]
    if on_cuda:
        tables += ["", "by own device time", averages.table(sort_by="self_device_time_total", row_limit=top)]
    tables += ["", "by own host time", averages.table(sort_by="self_cpu_time_total", row_limit=top)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tables) + "\n")
    print(head + f"\n  tables: {path}", flush=True)
    return summary
