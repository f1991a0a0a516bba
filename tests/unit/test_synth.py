"""The synthetic ticket generator: long-tailed lengths, determinism, labels, readable text."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from producer.synth import LABELS, compose_ticket, generate_tickets, sample_length, word_count

DATA_FILE = Path(__file__).parents[1] / "data" / "long_tail_tickets.jsonl"


@pytest.fixture(scope="module")
def many() -> list[dict]:
    return generate_tickets(20_000, seed=11)


def test_length_quantiles_match_helpdesk_shape(many):
    words = np.array([word_count(t["text"]) for t in many])
    p50, p90, p99 = np.percentile(words, [50, 90, 99])
    assert 20 <= p50 <= 26
    assert 78 <= p90 <= 100
    assert 250 <= p99 <= 360
    assert words.min() >= 3
    assert words.max() <= 950


def test_sampled_length_curve_reaches_its_max():
    rng = random.Random(0)
    lengths = [sample_length(rng) for _ in range(200_000)]
    assert 850 <= max(lengths) <= 950
    assert min(lengths) == 3


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("target", [3, 5, 8, 9, 12, 23, 60, 111, 300, 950])
def test_compose_hits_the_sampled_word_count(label, target):
    rng = random.Random(target)
    for _ in range(5):
        assert word_count(compose_ticket(rng, label, target)) == target


def test_same_seed_same_tickets_other_seed_differs():
    a, b, c = generate_tickets(300, seed=5), generate_tickets(300, seed=5), generate_tickets(300, seed=6)
    assert a == b
    assert [t["text"] for t in a] != [t["text"] for t in c]
    assert generate_tickets(50, seed=5) == a[:50]  # a prefix of a longer run


def test_ids_unique_and_labels_are_the_default_set(many):
    assert len({t["id"] for t in many}) == len(many)
    assert all(set(t) == {"id", "text", "label"} for t in many)
    counts = Counter(t["label"] for t in many)
    assert set(counts) == {"billing", "technical", "account", "shipping", "other"}
    assert min(counts.values()) > 0.05 * len(many)  # every category well represented


def test_long_tail_contains_pasted_material(many):
    long = [t for t in many if word_count(t["text"]) >= 200]
    assert long
    pasted = [
        t
        for t in long
        if "\n" in t["text"] and ("Original Message" in t["text"] or "Z " in t["text"] or "  " in t["text"])
    ]
    assert len(pasted) > 0.5 * len(long)
    logs = [t for t in long if t["label"] == "technical" and ("ERROR" in t["text"] or "WARN" in t["text"])]
    assert logs


def test_texts_are_varied_not_template_copies(many):
    texts = [t["text"] for t in many if word_count(t["text"]) >= 15]
    assert len(set(texts)) > 0.99 * len(texts)


def test_negative_n_rejected():
    with pytest.raises(ValueError):
        generate_tickets(-1)


def test_bundled_long_tail_file_is_generator_output():
    rows = [json.loads(line) for line in DATA_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) >= 200
    assert all(set(r) == {"id", "text", "label"} and r["label"] in LABELS and r["text"].strip() for r in rows)
    assert rows == generate_tickets(len(rows), seed=42)  # regenerate: triage-producer synth --n 250 --seed 42 --out ...
