"""The lines ``triage-bench`` prints beside its tables: what a ratio is against, what ran before the clock.

Kept out of ``cli`` (the run) so each reads and tests on its own (tests/unit/test_bench_report.py).
"""

from __future__ import annotations

from worker.bench.modes import MODE_ORDER


def prompt_note(clf) -> str:
    """Say when the prompt is not the task's: a head reads the short labels-only prompt (TRIAGE_HEAD_PROMPT=labels),
    so few-shot and zero-shot are then the same prompt (TRIAGE_HEAD_PROMPT=task measures the task's own)."""
    return ", head prompt: labels only" if getattr(clf, "head_prompt", None) == "labels" else ""


def ratio_note(runs: dict, n: int) -> str:
    """What the ratio columns compare: mode 1 on the same ``n`` tickets, or on its first N only (``--sequential-n``:
    the ratios are then per-ticket rates), and which modes ran a subsample of their own (``--baseline-n``)."""
    seq = runs.get("sequential")
    if seq is None:
        return f"{n} tickets (no mode 1: no ratios)"
    if seq.subsample:
        text = f"ratios vs mode 1 on the first {seq.subsample} of {n} tickets (per-ticket rates)"
    else:
        text = f"ratios vs mode 1, same {n} tickets"
    sub = {k: r.subsample for k, r in runs.items() if k != "sequential" and r.subsample}
    for size in sorted(set(sub.values())):
        nums = ",".join(str(MODE_ORDER.index(k) + 1) for k in MODE_ORDER if sub.get(k) == size)
        text += f"; mode{'s' if ',' in nums else ''} {nums} on the first {size}"
    return text


def captures_note(stats: dict, since: dict | None = None) -> str:
    """``stats``: running totals (``Classifier.graph_stats``); ``since``: totals before, to count only what is new."""
    n, s = stats["captures"] - (since or {}).get("captures", 0), stats["capture_s"] - (since or {}).get("capture_s", 0)
    return f"CUDA graphs: {n} pass shapes captured and checked in {s:.2f}s"


def unforeseen(prompt: str, what: str, warm: dict | None, after: dict | None) -> None:
    """Say so when a timed run still captured a graph (a shape its warm-up missed, or the MAX_GRAPHS limit)."""
    if warm and after and after["captures"] > warm["captures"]:
        print(f"[{prompt}] {what}: {captures_note(after, since=warm)} inside the timings", flush=True)
