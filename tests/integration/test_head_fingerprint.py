"""A fitted head is tied to the backbone's weights (a fingerprint recorded by `fit`), not to how TRIAGE_MODEL
spells the model's path: other weights under the same name are refused, the same weights under another spelling
are served. Heads without a fingerprint (older heads, the shipped ones) keep the name check."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_bert, build_tiny_model
from worker.assemble import build_classifier
from worker.cli import main
from worker.quality.head import Head, HeadMismatch
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TICKETS = ROOT / "tests" / "data" / "support_tickets_labelled.jsonl"
TEXTS = [
    "I was charged twice, refund please",
    "the app crashes on start",
    "cannot log in, password reset broken",
    "my package is lost in transit",
    "love the product, thanks",
    "invoice has the wrong VAT number",
]
KEY = "model_fingerprint"


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    """No TRIAGE_* from the caller's shell; returns the cache dir the fits and the builds share."""
    for k in [k for k in os.environ if k.startswith("TRIAGE_")]:
        monkeypatch.delenv(k)
    cache = tmp_path / "cache"
    for k, v in dict(TRIAGE_DEVICE="cpu", TRIAGE_DTYPE="fp32", TRIAGE_CACHE_DIR=str(cache)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TRIAGE_LOG_FORMAT", "json")
    return cache


def fit(model, out: Path, *extra: str) -> Head:
    args = ["fit", "--model", str(model), "--input", str(TICKETS), "--split", "train", "--out", str(out)]
    assert main([*args, "--no-progress", *extra]) == 0
    return Head.load(out)


def worker(model, head: Path, cache: Path, **kw):
    return build_classifier(
        Settings(model=str(model), head_path=head, device="cpu", dtype="fp32", cache_dir=cache, **kw)
    )


def labels(clf) -> list[str]:
    preds, _ = clf.classify(clf.prepare_valid(TEXTS))
    return [p.label for p in preds]


def test_a_head_is_refused_on_other_weights_under_the_same_model_path(env, tmp_path):
    model = build_tiny_model(tmp_path / "models" / "current", seed=0)
    head_path = tmp_path / "head.safetensors"
    fitted = fit(model, head_path).meta.get(KEY)
    assert fitted, f"fit records no {KEY}"
    assert worker(model, head_path, env).scorer.kind == "head"
    shutil.rmtree(model)
    build_tiny_model(model, seed=1)  # the directory's weights replaced: same shape, same tokenizer, same name
    with pytest.raises(HeadMismatch, match="weights differ from those the head was fitted on") as refused:
        worker(model, head_path, env)
    why = str(refused.value)
    assert fitted in why  # both fingerprints named: the one fitted on and the one found
    others = set(re.findall(r"[0-9a-f]{16}", why)) - set(re.findall(r"[0-9a-f]{16}", fitted))
    assert others, why


def test_the_same_weights_under_another_spelling_of_the_path_are_served(env, tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "m", seed=0)
    head_path = tmp_path / "head.safetensors"
    fit(model, head_path)
    want = labels(worker(model, head_path, env))
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    monkeypatch.setenv("HOME", str(tmp_path))
    for spelling in (f"{model}/", str(link), f"{link}/", "~/m"):
        clf = worker(spelling, head_path, env)
        assert clf.scorer.kind == "head" and clf.model_name == spelling
        assert labels(clf) == want, spelling


def test_a_head_without_a_fingerprint_keeps_the_name_check(env, tmp_path):
    model = build_tiny_model(tmp_path / "m", seed=0)
    head = fit(model, tmp_path / "new.safetensors")
    head.meta.pop(KEY, None)  # what older heads (and the shipped ones) carry
    old = tmp_path / "old.safetensors"
    head.save(old)
    assert worker(model, old, env).scorer.kind == "head"  # the same name: served as before
    with pytest.raises(HeadMismatch, match="model"):  # another spelling: only the name can be compared
        worker(f"{model}/", old, env)


def test_joined_features_fingerprint_the_encoder_too(env, tmp_path):
    lm = build_tiny_model(tmp_path / "lm", seed=0)
    bert = build_tiny_bert(tmp_path / "bert", seed=0)
    head_path = tmp_path / "joined.safetensors"
    fitted = fit(lm, head_path, "--encoder", str(bert)).meta.get(KEY)
    assert fitted and "+" in fitted  # one fingerprint per backbone, as the model name joins them
    assert worker(lm, head_path, env, encoder=f"{bert}/").scorer.kind == "head"
    shutil.rmtree(bert)
    build_tiny_bert(bert, seed=1)
    with pytest.raises(HeadMismatch, match="weights differ"):
        worker(lm, head_path, env, encoder=str(bert))
    with pytest.raises(HeadMismatch, match="model"):  # no encoder beside the LM: not the backbones it was fitted on
        worker(lm, head_path, env)


def test_default_head_recipe_records_no_fingerprint(env, tmp_path, tiny_model_dir):
    """The shipped heads must refit byte-identical (make default-head): the recipe's metadata is unchanged."""
    out = tmp_path / "default.safetensors"
    assert main(["fit", "--default-head", "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    assert KEY not in Head.load(out).meta


def test_fingerprint_reads_the_weights_actually_loaded_and_skips_models_without_files(tmp_path, tiny_model_dir):
    import dataclasses

    import torch

    from worker.engine.loader import load_model
    from worker.quality.fingerprint import model_fingerprint, weights_fingerprint

    loaded = load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32, tmp_path / "cache")
    fp = model_fingerprint(loaded)
    assert fp is not None and fp == weights_fingerprint(tiny_model_dir)
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert weights_fingerprint(copy) == fp  # content, not place
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" '))
    assert weights_fingerprint(copy) == fp  # the config's meaning, not its spacing
    config = json.loads((copy / "config.json").read_text())
    # keys a newer transformers writes, or runtime switches, on the same weights (a GGUF converted again after an
    # upgrade): not "the weights differ"
    (copy / "config.json").write_text(json.dumps({**config, "use_cache": False, "_attn_implementation_autoset": True}))
    assert weights_fingerprint(copy) == fp
    (copy / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))  # what the weights compute
    assert weights_fingerprint(copy) != fp
    assert model_fingerprint(dataclasses.replace(loaded, source="in-memory")) is None  # nothing on disk: skipped
    assert weights_fingerprint(tmp_path) is None  # no weights files
