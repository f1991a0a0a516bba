"""The scorer head, calibration and confidence threshold on the engine's real forward pass (tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.assemble import ScoringConfigError, build_classifier
from worker.engine.results import softmax
from worker.engine.task import Example, default_task
from worker.quality.calibration import content_free_items, contextual_bias
from worker.quality.features import run_features
from worker.quality.head import Head, HeadMismatch, HeadScorer, fit_head, prompt_hash
from worker.settings import Settings

TEXTS = [
    ("I was charged twice, refund please", "billing"),
    ("invoice has the wrong VAT number", "billing"),
    ("the app crashes on start", "technical"),
    ("error 500 when saving settings", "technical"),
    ("cannot log in, password reset broken", "account"),
    ("please delete my account", "account"),
    ("my package is lost in transit", "shipping"),
    ("tracking number does not work", "shipping"),
    ("do you have job openings?", "other"),
    ("love the product, thanks", "other"),
]


@pytest.fixture(scope="module")
def settings_for(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")

    def make(**kw) -> Settings:
        kw.setdefault("head_prompt", "task")  # the heads here are fitted under the full task prompt (`clf` below)
        return Settings(model=str(tiny_model_dir), device="cpu", dtype="fp32", cache_dir=cache, **kw)

    return make


@pytest.fixture(scope="module")
def clf(settings_for):
    return build_classifier(settings_for(scorer="prompt"))


@pytest.fixture(scope="module")
def fitted(clf, tmp_path_factory):
    """A logreg head on mean-pooled states of TEXTS, saved to disk."""
    items = clf.prepare_valid([t for t, _ in TEXTS])
    feats = run_features(clf, items, score=False, progress=False)
    meta = {"model": clf.model_name, "prompt_hash": prompt_hash(clf), "dtype": clf.dtype_name}
    head = fit_head(feats.mean, [lab for _, lab in TEXTS], clf.labels, method="logreg", pooling="mean", meta=meta)
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    head.save(path)
    return head, path, feats


def test_fit_head_separates_gaussian_blobs_with_both_methods():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 32)) * 4
    x = np.concatenate([c + rng.normal(size=(20, 32)) for c in centres])
    x[:, 0] *= 1000.0  # an outlier dimension, as LM hidden states have: standardisation must tame it
    y = [lab for lab in "abc" for _ in range(20)]
    test = np.concatenate([c + rng.normal(size=(5, 32)) for c in centres])
    test[:, 0] *= 1000.0
    for method in ("logreg", "centroid"):
        head = fit_head(x, y, "abc", method=method)
        probs = softmax(head.logits(test))
        assert probs.argmax(1).tolist() == [0] * 5 + [1] * 5 + [2] * 5, method
        assert np.allclose(probs.sum(1), 1.0)
    with pytest.raises(ValueError, match="no training examples"):
        fit_head(x, y, "abcd")


def test_a_head_fitted_on_fine_labels_answers_in_coarse_ones_as_sums(tmp_path):
    rng = np.random.default_rng(0)
    fine = ["refund", "invoice", "crash", "oos"]  # four clusters, three answers
    groups = {"refund": "billing", "invoice": "billing", "crash": "technical", "oos": "oos"}
    centres = rng.normal(size=(4, 16)) * 4
    x = np.concatenate([c + rng.normal(size=(15, 16)) for c in centres])
    y = [lab for lab in fine for _ in range(15)]
    test = np.concatenate([c + rng.normal(size=(3, 16)) for c in centres])
    head = fit_head(x, y, fine, groups=groups, outputs=["oos", "technical", "billing"])
    assert head.labels == tuple(fine) and head.outputs == ("oos", "technical", "billing")
    fine_probs = softmax(head.logits(test))
    probs = head.probs(test)
    assert np.allclose(probs[:, 2], fine_probs[:, 0] + fine_probs[:, 1]) and np.allclose(probs.sum(1), 1.0)
    assert [head.outputs[k] for k in probs.argmax(1)] == ["billing"] * 6 + ["technical"] * 3 + ["oos"] * 3
    path = tmp_path / "grouped.safetensors"
    head.save(path)
    back = Head.load(path).reordered(["billing", "oos", "technical"])
    assert np.allclose(back.probs(test), probs[:, [2, 0, 1]], atol=1e-5)
    # the worker's scorer sums the same way (log-probabilities over the coarse labels, in its order)
    scorer = HeadScorer(back)
    fwd = type("Fwd", (), {"h_mean": torch.tensor(test, dtype=torch.float32), "h_last": None})()
    assert scorer.names == ("billing", "oos", "technical")
    assert np.allclose(scorer.scores(None, fwd).exp().numpy(), back.probs(test), atol=1e-4)
    with pytest.raises(ValueError, match="without a coarse label"):
        fit_head(x, y, fine, groups={k: v for k, v in groups.items() if k != "oos"})
    with pytest.raises(ValueError, match="outside"):
        fit_head(x, y, fine, groups=groups, outputs=["billing", "technical"])


def test_head_file_is_safetensors_with_json_metadata_and_round_trips(fitted, clf):
    head, path, _ = fitted
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and b"triage_head" in raw[8 : 8 + header_len]  # safetensors header, no pickle
    back = Head.load(path)
    assert back.labels == clf.labels and back.pooling == "mean" and back.method == "logreg"
    assert back.meta["prompt_hash"] == prompt_hash(clf) and back.meta["n_train"] == len(TEXTS)
    x = np.random.default_rng(1).normal(size=(4, head.mean.shape[0]))
    assert np.allclose(back.logits(x), head.logits(x), atol=1e-3)
    flipped = back.reordered(tuple(reversed(clf.labels)))
    assert np.allclose(flipped.logits(x), back.logits(x)[:, ::-1])


def test_head_scorer_batched_path_matches_reference_and_offline_features(clf, fitted):
    head, _, _ = fitted
    texts = [t for t, _ in TEXTS] + ["a much longer ticket " * 12, "short"]
    items = clf.prepare_valid(texts)
    with_head = clf.with_scoring(HeadScorer(head))
    assert clf.scorer.kind == "prompt" and with_head.scorer.kind == "head"  # a new classifier; clf is left as it was
    batched, stats = with_head.classify(items)
    reference = with_head.reference(items)
    assert stats.passes >= 1 and stats.prefix_tokens_reused > 0  # prefix-cached, bucketed
    assert [p.label for p in batched] == [p.label for p in reference]
    for a, b in zip(batched, reference):
        assert a.scores == pytest.approx(b.scores, abs=1e-4)
    offline = softmax(head.logits(run_features(clf, items, score=False, progress=False).mean))  # what eval measures
    assert np.allclose(offline, [[p.scores[lab] for lab in clf.labels] for p in batched], atol=1e-4)
    # the head was fitted on these very texts: it must have learned them
    assert sum(p.label == lab for p, (_, lab) in zip(batched, TEXTS)) >= 8


def test_worker_settings_load_check_and_refuse_heads(settings_for, fitted, tmp_path):
    _, path, _ = fitted
    with pytest.raises(ScoringConfigError, match="TRIAGE_HEAD_PATH"):
        build_classifier(settings_for(scorer="head"))
    auto = build_classifier(settings_for(head_path=path))  # scorer=auto is the default
    assert auto.scorer.kind == "head" and not auto.scorer.needs_cache and auto.scorer.needs_mean
    assert build_classifier(settings_for(scorer="prompt", head_path=path)).scorer.kind == "prompt"
    # a different prompt (other examples) or label set: the head's features would not mean the same
    other = default_task().with_examples([Example("my card was charged", "billing")])
    with pytest.raises(HeadMismatch, match="prompt"):
        build_classifier(settings_for(head_path=path), task=other)
    with pytest.raises(HeadMismatch, match="labels"):
        build_classifier(settings_for(head_path=path, labels="billing,technical"))
    bad = tmp_path / "not-a-head.safetensors"
    bad.write_bytes(b"garbage")
    with pytest.raises(ScoringConfigError, match="cannot load"):
        build_classifier(settings_for(head_path=bad))


def test_contextual_calibration_setting_makes_content_free_tickets_uniform(settings_for, clf, fitted):
    cal = build_classifier(settings_for(scorer="prompt", calibration="contextual"))
    assert np.allclose(cal.score_bias, contextual_bias(clf)) and np.abs(cal.score_bias).max() > 1e-3
    cf = content_free_items(cal)
    assert [p.n_text_tokens for p in cf][1] == 0  # the empty ticket: just the answer cue
    raw = softmax(clf.run_pass(cf)).mean(0)
    calibrated = np.array([[p.scores[lab] for lab in cal.labels] for p in cal.postprocess(cal.run_pass(cf), cf)])
    uniform = np.full(len(cal.labels), 1 / len(cal.labels))
    assert np.abs(raw - uniform).max() > 0.01
    # geometric-mean correction: exact uniformity for one content-free input, close to it for the average of three
    assert np.abs(calibrated.mean(0) - uniform).max() < np.abs(raw - uniform).max() / 2
    _, path, _ = fitted
    with_head = build_classifier(settings_for(head_path=path, calibration="contextual"))
    assert with_head.scorer.kind == "head" and not with_head.score_bias.any()  # a fitted head is left as fitted


def test_confidence_threshold_marks_low_confidence_results_as_fallback(settings_for):
    texts = [t for t, _ in TEXTS]
    plain = build_classifier(settings_for(scorer="prompt")).classify_texts(texts)
    top = sorted(p.score for p in plain)
    cut = (top[len(top) // 2 - 1] + top[len(top) // 2]) / 2  # half the tickets fall below
    strict = build_classifier(settings_for(scorer="prompt", confidence_threshold=cut, fallback_label="needs_review"))
    preds = strict.classify_texts(texts)
    for p, q in zip(plain, preds):
        assert q.scores == pytest.approx(p.scores)  # probabilities are reported either way
        assert q.label == (p.label if p.score >= cut else "needs_review")
    assert sum(q.label == "needs_review" for q in preds) == len(texts) // 2


def test_default_start_up_fits_a_centroid_head_on_the_task_examples_unless_told_otherwise(settings_for):
    clf = build_classifier(settings_for())  # scorer=auto, built-in task with one example per label
    assert clf.scorer.kind == "head"
    head = clf.scorer.head
    assert (head.method, head.pooling, head.meta["n_train"], head.meta["source"]) == (
        "centroid",
        "mean",
        5,
        "task examples",
    )
    examples = clf.task.examples
    items = clf.prepare_valid([e.text for e in examples] + [t for t, _ in TEXTS])
    batched, _ = clf.classify(items)
    reference = clf.reference(items)
    assert [p.label for p in batched] == [p.label for p in reference]
    for a, b in zip(batched, reference):
        assert a.scores == pytest.approx(b.scores, abs=1e-4)
    # an example's own hidden state is its class centroid: it must come back with its label
    assert [p.label for p in batched[: len(examples)]] == [e.label for e in examples]
    assert build_classifier(settings_for(scorer="prompt")).scorer.kind == "prompt"
    assert build_classifier(settings_for(labels="billing,other")).scorer.kind == "prompt"  # no examples
