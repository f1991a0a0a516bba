"""The tickets and prompt variants a benchmark run measures.

Every mode runs on exactly these texts, so throughput ratios and label
agreement compare like with like.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from worker.engine.types import InvalidTicket, percentile
from worker.ticket_files import read_tickets

PROMPTS = ("few-shot", "zero-shot")


@dataclass(frozen=True)
class Workload:
    source: str  # "synthetic(seed=0)" or the input file path
    texts: tuple[str, ...]
    labels: tuple[str | None, ...]  # intended/gold label where the source has one (not used for speed)

    @property
    def n(self) -> int:
        return len(self.texts)


def synthetic(n: int, seed: int = 0) -> Workload:
    """Long-tailed synthetic tickets from ``producer.synth`` (median ~23 words, max ~950)."""
    from producer.synth import generate_tickets

    tickets = generate_tickets(n, seed=seed)
    return Workload(
        f"synthetic(seed={seed})", tuple(t["text"] for t in tickets), tuple(t.get("label") for t in tickets)
    )


def from_file(path: str | Path, n: int | None, seed: int = 0) -> Workload:
    """JSON Lines (``text`` field) or CSV (``text`` column).

    With ``n`` smaller than the file, a seeded random sample (kept in file order)
    is taken: dataset files are often sorted by label, and the first ``n`` rows
    would all be one intent.
    """
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows with a non-empty 'text'")
    if n is not None and n < len(rows):
        keep = sorted(random.Random(seed).sample(range(len(rows)), n))
        rows = [rows[i] for i in keep]
    label = lambda r: str(r["label"]) if r.get("label") not in (None, "") else None  # noqa: E731
    return Workload(str(path), tuple(str(r["text"]) for r in rows), tuple(label(r) for r in rows))


def _read_rows(path: Path) -> list[dict]:
    """The file's rows with a non-empty text (the worker would dead-letter the others: nothing to time)."""
    return [r for r in read_tickets(path) if isinstance(r.get("text"), str) and r["text"].strip()]


def without_invalid(wk: Workload, clf) -> tuple[Workload, list, dict[str, int]]:
    """``wk`` less the tickets ``clf`` refuses (``Classifier.prepare``: with ``TRIAGE_TRUNCATE=false`` those over the
    token limit, which the worker would dead-letter), the kept tickets prepared, and how many were dropped, by reason.

    Dropped once, before any mode runs, so every mode (and mode 6's worker) runs the same tickets; every prompt's
    classifier shares ``clf``'s tokenizer and limit."""
    prepared = clf.prepare(list(wk.texts))
    bad = [(i, p) for i, p in enumerate(prepared) if isinstance(p, InvalidTicket)]
    reasons = {i: re.sub(r"^ticket is \d+ tokens, ", "", str(p)) for i, p in bad}  # one reason per limit
    if not reasons:
        return wk, prepared, {}
    keep = [i for i in range(wk.n) if i not in reasons]
    kept = Workload(wk.source, tuple(wk.texts[i] for i in keep), tuple(wk.labels[i] for i in keep))
    return kept, [prepared[i] for i in keep], dict(Counter(reasons.values()))


def prompt_tasks(base_task, prompt: str) -> list[tuple[str, object]]:
    """``few-shot`` = the configured task (with its examples); ``zero-shot`` = the same without examples."""
    if prompt not in (*PROMPTS, "both"):
        raise ValueError(f"--prompt must be one of {PROMPTS + ('both',)}")
    wanted = PROMPTS if prompt == "both" else (prompt,)
    return [(name, base_task if name == "few-shot" else base_task.without_examples()) for name in wanted]


def length_summary(lengths: list[int]) -> dict[str, float]:
    """p50/p90/p99/max/mean/sum of a length list (nearest-rank percentiles: lengths that occurred)."""
    if not lengths:
        return {"n": 0}
    s = sorted(lengths)

    def pct(q: float) -> int:
        return percentile(s, q, nearest=True)

    return {
        "n": len(s),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": s[-1],
        "mean": round(sum(s) / len(s), 1),
        "sum": sum(s),
    }
