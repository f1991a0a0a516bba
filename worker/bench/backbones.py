"""Backbones side by side: the worker's own path (length buckets; prefix cache where there is a prefix)
for a causal LM, an encoder and both joined, on the same tickets in one run.

Passes are interleaved round-robin across the backbones, so each meets the same load from
other processes; items/s counts only a backbone's own passes (wall and process CPU time).
Each backbone runs with the scorer the worker would pick for it (its shipped head, a head
file, ...), so the figures are what a worker on that backbone would do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from worker.engine.types import padding_pct


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``MODEL`` or ``LM+ENCODER`` (joined features)."""
    model, _, encoder = spec.partition("+")
    if not model.strip():
        raise ValueError(f"empty backbone in {spec!r}")
    return model.strip(), (encoder.strip() or None)


def run_backbones(
    settings, specs: Sequence[str], texts: Sequence[str], on_pass: Callable[[int], None] = lambda n: None
) -> list[dict]:
    from worker.assemble import build_classifier

    runs = []
    for spec in specs:
        model, encoder = parse_spec(spec)
        clf = build_classifier(settings.model_copy(update={"model": model, "encoder": encoder}))
        items = clf.prepare_valid(list(texts))
        clf.classify(items[:2])  # warm-up: first-call allocations stay out of the timings
        runs.append(
            {
                "spec": spec,
                "clf": clf,
                "items": items,
                "passes": clf.plan(items),
                "next": 0,
                "wall_s": 0.0,
                "cpu_s": 0.0,
                "padded": 0,
                "real": 0,
            }
        )
    while any(r["next"] < len(r["passes"]) for r in runs):
        for r in runs:
            if r["next"] >= len(r["passes"]):
                continue
            b = r["passes"][r["next"]]
            r["next"] += 1
            t0, c0 = time.perf_counter(), time.process_time()
            _, stats = r["clf"].classify(r["items"], [b])
            r["wall_s"] += time.perf_counter() - t0
            r["cpu_s"] += time.process_time() - c0
            r["padded"] += stats.padded_tokens
            r["real"] += stats.real_tokens
            on_pass(b.size)
    out = []
    for r in runs:
        clf, n = r["clf"], len(r["items"])
        out.append(
            {
                "backbone": r["spec"],
                "kind": "joined" if clf.encoder is not None else clf.kind,
                "scorer": getattr(clf.scorer, "source", None) or clf.scorer.kind,
                "prefix_tokens": clf.prefix_length,
                "feature_dim": clf.feature_dim,
                "passes": len(r["passes"]),
                "items": n,
                "wall_s": round(r["wall_s"], 3),
                "cpu_s": round(r["cpu_s"], 3),
                "items_per_s": n / r["wall_s"] if r["wall_s"] else None,
                "items_per_cpu_s": n / r["cpu_s"] if r["cpu_s"] else None,
                "padding_pct": padding_pct(r["real"], r["padded"]),
            }
        )
    first = out[0]["items_per_s"] if out else None
    for row in out:
        row["vs_first"] = row["items_per_s"] / first if first and row["items_per_s"] else None
    return out


def table(rows: list[dict]) -> str:
    head = (
        f"{'backbone':34s} {'kind':8s} {'scorer':34s} {'prefix':>6s} {'passes':>6s} "
        f"{'items/s':>8s} {'items/CPU-s':>11s} {'pad%':>5s} {'x first':>7s}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['backbone'][:34]:34s} {r['kind']:8s} {str(r['scorer'])[:34]:34s} "
            f"{r['prefix_tokens']:6d} {r['passes']:6d} {r['items_per_s']:8.1f} "
            f"{r['items_per_cpu_s'] or 0:11.1f} {r['padding_pct']:5.1f} {r['vs_first'] or 0:7.2f}"
        )
    return "\n".join(lines)
