"""Encoder backbones (BERT family) and joined LM + encoder features through the same engine (tiny models)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch

from worker.assemble import ScoringConfigError, build_classifier
from worker.engine.classifier import Classifier, InvalidTicket, softmax
from worker.engine.loader import ModelNotFound, load_model, unzipped_dir
from worker.engine.task import default_task
from worker.observability.reasons import reason_class
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
LONG = ["a much longer ticket about a refund that never arrived " * 3, "short", "ok"]


@pytest.fixture(scope="module")
def loaded_bert(tiny_bert_dir, tmp_path_factory):
    return load_model(str(tiny_bert_dir), torch.device("cpu"), torch.float32, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def loaded_lm(tiny_model_dir, tmp_path_factory):
    return load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32, tmp_path_factory.mktemp("cache"))


def _fit(clf: Classifier) -> Head:
    feats = run_features(clf, clf.prepare_valid([t for t, _ in TEXTS]), score=False, progress=False)
    meta = {"model": clf.model_name, "prompt_hash": prompt_hash(clf), "head_prompt": clf.head_prompt}
    return fit_head(feats.mean, [lab for _, lab in TEXTS], clf.labels, meta=meta, blocks=clf.feature_blocks)


def test_loader_reads_the_kind_from_the_config(loaded_bert, loaded_lm):
    assert (loaded_bert.kind, loaded_lm.kind) == ("encoder", "decoder")
    assert loaded_bert.max_length == 64  # sentence_bert_config.json's max_seq_length, below the 128 positions
    assert type(loaded_bert.model).__name__ == "BertModel"


def test_encoder_rows_are_cls_text_sep_and_pool_like_sentence_transformers(loaded_bert):
    clf = Classifier(loaded_bert, default_task(), max_input_tokens=512)
    tok = loaded_bert.tokenizer
    assert clf.kind == "encoder" and not clf.use_prefix_cache and clf.prefix_length == 0
    assert clf.max_input_tokens == 62  # 64 positions less [CLS] and [SEP]
    items = clf.prepare_valid([t for t, _ in TEXTS] + LONG)
    for p, text in zip(items, [t for t, _ in TEXTS] + LONG):
        assert p.ids == tuple(
            tok(text, truncation=True, max_length=64)["input_ids"]
        )  # what the tokenizer itself frames
    feats = run_features(clf, items, score=False, progress=False)
    assert len(clf.plan(items)) >= 2  # length buckets, as for a causal LM
    for i, p in enumerate(items):  # each ticket alone, plain mask-weighted mean over every token
        alone = loaded_bert.model(input_ids=torch.tensor([p.ids])).last_hidden_state[0].mean(0)
        assert np.allclose(feats.mean[i], alone.detach().numpy(), atol=1e-5)


def test_text_the_encoders_tokenizer_drops_whole_is_refused_as_empty(loaded_bert):
    """BERT's normalizer drops control and format characters: such a ticket has no token to classify."""
    clf = Classifier(loaded_bert, default_task(), max_input_tokens=512)
    out = clf.prepare(["refund please", "\u200b\u200b", "\x00\x01\x02"])
    assert not isinstance(out[0], InvalidTicket)
    assert all(isinstance(o, InvalidTicket) and "is empty" in str(o) for o in out[1:])
    assert reason_class(str(out[1])) == "empty_text"


def test_encoder_truncates_to_its_position_limit_and_flags_it(loaded_bert):
    clf = Classifier(loaded_bert, default_task(), max_input_tokens=512)
    (p,) = clf.prepare_valid(["refund " * 200])
    assert len(p.ids) == 64 and p.truncated and p.n_text_tokens == 62
    strict = Classifier(loaded_bert, default_task(), truncate=False)
    assert "over the 62-token limit" in str(strict.prepare(["refund " * 200])[0])


def test_joined_features_flag_the_encoders_cut_and_refuse_it_with_truncation_off(loaded_lm, loaded_bert):
    """The encoder of joined features cuts at its own limit (64 here, MiniLM's 254): that ticket is flagged
    truncated, and with TRIAGE_TRUNCATE=false refused like any other over a limit (it was cut all the same)."""
    text = "refund " * 80  # ~80 tokens: within the LM's limit, over the encoder's
    cut = Classifier(loaded_lm, default_task(), encoder=loaded_bert).prepare([text])[0]
    assert cut.truncated and cut.n_text_tokens < Classifier(loaded_lm, default_task()).framing.limit
    (refused,) = Classifier(loaded_lm, default_task(), encoder=loaded_bert, truncate=False).prepare([text])
    assert (
        isinstance(refused, InvalidTicket) and "for the encoder" in str(refused) and "truncation is off" in str(refused)
    )


def test_encoder_with_a_head_batched_equals_reference_and_prompt_scoring_is_refused(
    loaded_bert, tiny_bert_dir, tmp_path
):
    clf = Classifier(loaded_bert, default_task())
    with pytest.raises(RuntimeError, match="needs a head"):
        clf.classify_texts(["hello"])
    head = _fit(clf)
    path = tmp_path / "enc.safetensors"
    head.save(path)
    scored = Classifier(loaded_bert, default_task(), scorer=HeadScorer(Head.load(path)))
    items = scored.prepare_valid([t for t, _ in TEXTS] + LONG)
    batched, stats = scored.classify(items)
    reference = scored.reference(items)
    assert stats.prefix_tokens_reused == 0 and stats.padded_tokens >= stats.real_tokens
    for a, b in zip(batched, reference):
        assert a.label == b.label and a.scores == pytest.approx(b.scores, abs=1e-5)
    assert sum(p.label == lab for p, (_, lab) in zip(batched, TEXTS)) >= 8  # it learned its training tickets
    base = dict(model=str(tiny_bert_dir), device="cpu", dtype="fp32", cache_dir=tmp_path / "c")
    with_head = build_classifier(Settings(**base, head_path=path))
    assert with_head.scorer.kind == "head" and with_head.kind == "encoder"
    with pytest.raises(ScoringConfigError, match="label tokens"):
        build_classifier(Settings(**base, scorer="prompt"))
    with pytest.raises(ScoringConfigError, match="needs a head"):
        build_classifier(Settings(**base, labels="billing,other"))
    auto = build_classifier(Settings(**base))  # built-in task: a centroid head on its 5 examples
    assert auto.scorer.kind == "head" and auto.scorer.head.meta["source"] == "task examples"


def test_joined_features_run_both_models_on_the_same_passes(
    loaded_lm, loaded_bert, tiny_model_dir, tiny_bert_dir, tmp_path
):
    with pytest.raises(ValueError, match="causal LM plus an encoder"):
        Classifier(loaded_bert, default_task(), encoder=loaded_lm)
    clf = Classifier(loaded_lm, default_task(), encoder=loaded_bert, head_prompt="labels")
    assert clf.model_name == f"{tiny_model_dir}+{tiny_bert_dir}"
    assert clf.feature_blocks == (64, 48) and clf.feature_dim == 112
    items = clf.prepare_valid([t for t, _ in TEXTS] + LONG)
    assert all(p.aux_ids[0] == loaded_bert.tokenizer.cls_token_id for p in items)
    lm_only = Classifier(loaded_lm, default_task(), head_prompt="labels")
    enc_only = Classifier(loaded_bert, default_task())
    texts = [t for t, _ in TEXTS] + LONG
    joined = run_features(clf, items, score=False, progress=False).mean
    parts = [run_features(c, c.prepare_valid(texts), score=False, progress=False).mean for c in (lm_only, enc_only)]
    assert np.allclose(joined, np.concatenate(parts, axis=1), atol=1e-4)  # LM states, then the encoder's
    head = _fit(clf)
    assert head.blocks == (64, 48)
    z = head.transform(joined)
    assert np.allclose(np.linalg.norm(z[:, :64], axis=1), 8.0) and np.allclose(
        np.linalg.norm(z[:, 64:], axis=1), np.sqrt(48)
    )
    path = tmp_path / "joined.safetensors"
    head.save(path)
    base = dict(model=str(tiny_model_dir), device="cpu", dtype="fp32", cache_dir=tmp_path / "c")
    worker = build_classifier(Settings(**base, encoder=str(tiny_bert_dir), head_path=path))
    batched, _ = worker.classify(worker.prepare_valid(texts))
    reference = worker.reference(worker.prepare_valid(texts))
    for a, b in zip(batched, reference):
        assert a.label == b.label and a.scores == pytest.approx(b.scores, abs=1e-4)
    offline = softmax(head.logits(joined))
    assert np.allclose(offline, [[p.scores[lab] for lab in worker.labels] for p in batched], atol=1e-4)
    with pytest.raises(HeadMismatch, match="model"):  # the same head without the encoder beside the LM
        build_classifier(Settings(**base, head_path=path))
    with pytest.raises(ScoringConfigError, match="label tokens"):
        build_classifier(Settings(**base, encoder=str(tiny_bert_dir), scorer="prompt"))


def test_head_records_its_prompt_and_is_refused_under_the_other(loaded_lm, tmp_path):
    short = Classifier(loaded_lm, default_task(), head_prompt="labels")
    full = Classifier(loaded_lm, default_task(), head_prompt="task")
    assert short.prefix_length < full.prefix_length  # no descriptions, no examples
    head = _fit(short)
    head.check(short)
    with pytest.raises(HeadMismatch, match="'labels' prompt"):
        head.check(full)


def test_bundled_zip_is_unzipped_once_and_unsafe_paths_are_refused(tmp_path):
    good = tmp_path / "pkg" / "model.zip"
    good.parent.mkdir()
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("1_Pooling/config.json", "{}")
    first = unzipped_dir(good, tmp_path / "cache")
    assert (first / "config.json").is_file() and (first / "1_Pooling" / "config.json").is_file()
    (first / "marker").write_text("kept")
    assert unzipped_dir(good, tmp_path / "cache") == first and (first / "marker").is_file()  # not unzipped again
    bad = tmp_path / "bad" / "model.zip"
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("../evil.txt", "x")
    with pytest.raises(ModelNotFound, match="unsafe path"):
        unzipped_dir(bad, tmp_path / "cache")
    assert not (tmp_path / "evil.txt").exists()


def test_bench_compares_backbones_in_one_run(tiny_model_dir, tiny_bert_dir, tmp_path, monkeypatch):
    import json

    from worker.bench.cli import main as bench_main

    for k in [k for k in __import__("os").environ if k.startswith("TRIAGE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TRIAGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    specs = f"{tiny_model_dir},{tiny_bert_dir},{tiny_model_dir}+{tiny_bert_dir}"
    assert (
        bench_main(
            [
                "--model",
                str(tiny_model_dir),
                "--device",
                "cpu",
                "--dtype",
                "fp32",
                "--quick",
                "--modes",
                "5",
                "--backbones",
                specs,
                "--no-progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["backbones"]
    assert [r["kind"] for r in rows] == ["decoder", "encoder", "joined"]
    assert rows[1]["prefix_tokens"] == 0 and rows[0]["prefix_tokens"] > 0  # no prefix for a bidirectional encoder
    assert all(r["items"] == 4 and r["items_per_s"] > 0 and r["scorer"] == "task examples" for r in rows)
    assert rows[2]["feature_dim"] == rows[0]["feature_dim"] + rows[1]["feature_dim"] and rows[0]["vs_first"] == 1.0


@pytest.mark.parametrize("joined", [False, True])
def test_eval_and_fit_work_for_an_encoder_and_for_joined_features(
    joined, tiny_model_dir, tiny_bert_dir, tmp_path, monkeypatch
):
    import json
    from pathlib import Path

    from worker.cli import main

    for k in [k for k in __import__("os").environ if k.startswith("TRIAGE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TRIAGE_CACHE_DIR", str(tmp_path / "cache"))
    tickets = str(Path(__file__).parents[1] / "data" / "support_tickets_labelled.jsonl")
    model = (
        ["--model", str(tiny_model_dir), "--encoder", str(tiny_bert_dir)] if joined else ["--model", str(tiny_bert_dir)]
    )
    flags = model + ["--device", "cpu", "--dtype", "fp32", "--no-progress"]
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "--input",
                tickets,
                "--split",
                "test",
                "--limit",
                "10",
                "--train",
                tickets,
                "--train-split",
                "train",
                "--pooling",
                "mean",
                "--json",
                str(out),
            ]
            + flags
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert {m["method"] for m in report["methods"]} == {"head"}  # no label tokens: heads only, and it says so
    assert any("no label tokens" in s for s in report["skipped"])
    assert "head logreg/mean" in {m["name"] for m in report["methods"]}
    head_path = tmp_path / "head.safetensors"
    assert main(["fit", "--input", tickets, "--split", "train", "--out", str(head_path)] + flags) == 0
    head = Head.load(head_path)
    assert head.blocks == ((64, 48) if joined else (48,))
    settings = Settings(
        model=model[1],
        encoder=model[3] if joined else None,
        device="cpu",
        dtype="fp32",
        cache_dir=tmp_path / "cache",
        head_path=head_path,
    )
    clf = build_classifier(settings)
    assert clf.scorer.kind == "head" and clf.feature_dim == sum(head.blocks)


def test_a_roberta_style_encoder_truncates_to_the_positions_it_has(tmp_path):
    """RoBERTa, XLM-R, CamemBERT and MPNet number positions from padding_idx + 1: of 514 positions 512 hold tokens.
    The limit was read as 514, so every ticket that long failed in the model (an index error) instead of being
    truncated. A tiny RoBERTa with 34 positions (pad id 0: 33 usable) classifies a long ticket, truncated."""
    from transformers import RobertaConfig, RobertaModel

    from tests.tiny_model import build_bert_tokenizer

    tok = build_bert_tokenizer()
    torch.manual_seed(0)
    cfg = RobertaConfig(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=34,
        pad_token_id=tok.pad_token_id,
        architectures=["RobertaModel"],
    )
    RobertaModel(cfg).save_pretrained(tmp_path / "roberta")
    tok.save_pretrained(tmp_path / "roberta")
    loaded = load_model(str(tmp_path / "roberta"), torch.device("cpu"), torch.float32, tmp_path / "cache")
    assert loaded.max_length == 34 - (tok.pad_token_id + 1)
    clf = Classifier(loaded, default_task(), max_input_tokens=512)
    clf = clf.with_scoring(HeadScorer(_fit(clf)))
    items = clf.prepare_valid([LONG[0] * 3, "short"])
    assert items[0].truncated and len(items[0].ids) == loaded.max_length
    preds, _ = clf.classify(items)
    assert [p.label in clf.labels for p in preds] == [True, True]
