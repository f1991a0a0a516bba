"""Models whose attention the fast paths do not reproduce (a sliding window, soft-capped logits) run the model's
own attention instead: the same answers as the reference, never a crash or a quietly different probability."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from tests.tiny_model import build_tokenizer, scaled_up
from worker.bench.modes import MODES, cached, title
from worker.engine.classifier import Classifier
from worker.engine.loader import load_model
from worker.engine.task import default_task
from worker.engine.verify import verify

TEXTS = ["I was charged twice", "x", "The app crashes when I open settings. " * 30, "Where is my parcel?"]


def _gemma2(path, window: int, softcap: float | None):
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,  # layer 0 slides, layer 1 sees everything
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=window,
        attn_logit_softcapping=softcap,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    model = scaled_up(Gemma2ForCausalLM(cfg))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return load_model(str(path), torch.device("cpu"), torch.float32, path / "cache")


def _agrees(clf: Classifier) -> float:
    items = clf.prepare_valid(TEXTS)
    got, _ = clf.classify(items)
    return max(abs(g.scores[k] - r.scores[k]) for g, r in zip(got, clf.reference(items)) for k in g.scores)


@pytest.mark.parametrize("attention", ["padded", "packed"])
def test_a_window_shorter_than_the_rows_turns_the_fast_paths_off(tmp_path, attention, caplog):
    lm = _gemma2(tmp_path / "m", window=16, softcap=None)  # the prompt prefix alone is hundreds of tokens
    with caplog.at_level(logging.WARNING, logger="triage.engine"):
        clf = Classifier(lm, default_task(), attention=attention)
    assert not clf.use_prefix_cache and clf.attention == "padded" and clf.scorer.needs_cache
    assert "16-token window" in clf.fast_paths.prefix_cache and "TRIAGE_MAX_INPUT_TOKENS" in clf.fast_paths.prefix_cache
    assert "prefix cache is off" in caplog.text
    assert _agrees(clf) < 1e-6  # multi-token labels: their continuations run one ticket at a time
    items = clf.prepare_valid(TEXTS)
    report = verify(clf, items, [str(i) for i in range(len(items))])
    assert report.passed(0.05) and not report.prefix_cache and report.attention == "padded"
    assert not cached(MODES["bucketed_cached"], clf) and "cache off" in title(MODES["bucketed_cached"], clf)


def test_a_window_no_row_reaches_keeps_the_fast_paths(tmp_path):
    lm = _gemma2(tmp_path / "m", window=4096, softcap=None)
    clf = Classifier(lm, default_task(), attention="packed")
    assert clf.use_prefix_cache and clf.attention == "packed" and clf.fast_paths.packed is None
    assert _agrees(clf) < 1e-5


def test_soft_capped_logits_keep_the_prefix_cache_but_not_packed_attention(tmp_path):
    lm = _gemma2(tmp_path / "m", window=4096, softcap=5.0)  # a low cap: it changes every score visibly
    clf = Classifier(lm, default_task(), attention="packed")
    assert clf.use_prefix_cache and clf.attention == "padded" and "soft-caps" in clf.fast_paths.packed
    assert _agrees(clf) < 1e-5
    assert _agrees(Classifier(lm, default_task(), attention="padded").with_scoring()) < 1e-5
