"""The default start-up (head fitted on the task's examples) on the real offline SmolLM2-135M model."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from worker.assemble import build_classifier
from worker.quality.data import load_labelled
from worker.quality.metrics import evaluate
from worker.settings import Settings

TICKETS = Path(__file__).parent / "data" / "support_tickets_labelled.jsonl"


@pytest.mark.real_model
def test_default_worker_scoring_beats_chance_by_far_and_batched_agrees_with_reference(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TRIAGE_") and k != "TRIAGE_CACHE_DIR"]:
        monkeypatch.delenv(k)  # the defaults a fresh worker starts with
    clf = build_classifier(Settings())
    assert clf.scorer.kind == "head"
    test = load_labelled(TICKETS, split="test")
    sample, seen = [], Counter()
    for r in test:  # the first 5 test tickets of each label
        if seen[r.label] < 5:
            sample.append(r)
            seen[r.label] += 1
    items = clf.prepare_valid([r.text for r in sample])
    preds, stats = clf.classify(items)
    rep = evaluate([r.label for r in sample], [p.label for p in preds], clf.labels, [p.score for p in preds])
    # measured 0.77 on all 60 test tickets (label-token prompting: 0.27); chance is 0.2
    assert rep.accuracy >= 0.6, rep.to_dict()
    reference = clf.reference(items[:6])
    for b, r in zip(preds[:6], reference):
        top = sorted(r.scores.values())
        assert b.label == r.label or top[-1] - top[-2] < 0.05  # bf16: only near-ties may flip
        assert max(abs(b.scores[k] - r.scores[k]) for k in r.scores) < 0.05
