"""TRIAGE_DTYPE=auto picks fp16 on a GPU. A model whose numbers pass fp16's range (65,504) then scores every ticket
NaN, and every ticket would be dead-lettered: the loader probes one sentence and loads the model again in a safer
dtype, for every process that loads through it (worker, bench, eval, verify).

Real tiny models through real transformers code, in fp16 on the CPU; only auto's device rule is set to "fp16 here",
as it is on CUDA (auto never picks fp16 on a CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.tiny_model import edited_model
from worker.assemble import build_classifier
from worker.bench.cli import build_classifiers
from worker.engine import device
from worker.engine.results import NonFiniteScores
from worker.engine.task import default_task
from worker.settings import Settings

TICKETS = ["my card was charged twice", "the app crashes on login"]


@pytest.fixture
def auto_is_fp16(monkeypatch):
    real = device.pick_dtype
    monkeypatch.setattr(device, "pick_dtype", lambda d, req="auto": torch.float16 if req == "auto" else real(d, req))


@pytest.fixture(scope="module")
def out_of_fp16_range(tiny_model_dir, tmp_path_factory):
    """The tiny model with its embeddings 10^6 times larger: most are over 65,504 (inf in fp16), all fine in
    bf16 and fp32 (the first norm scales them back)."""
    return edited_model(tiny_model_dir, tmp_path_factory.mktemp("out-of-fp16-range"), lambda emb: emb.mul_(1e6))


def settings(model, tmp_path, **kw) -> Settings:
    return Settings(model=str(model), device="cpu", cache_dir=str(tmp_path), **kw)


def test_auto_loads_the_model_again_in_a_safer_dtype_when_fp16_overflows(
    out_of_fp16_range, tmp_path, auto_is_fp16, caplog
):
    with pytest.raises(NonFiniteScores):  # the premise: fp16 set by hand overflows on this model
        build_classifier(settings(out_of_fp16_range, tmp_path, dtype="fp16")).classify_texts(TICKETS)
    with caplog.at_level(logging.WARNING, logger="triage.assemble"):
        clf = build_classifier(settings(out_of_fp16_range, tmp_path))
    assert clf.dtype_name == "fp32"  # a CPU has no fast bf16 to fall back on; CUDA: bf16 where the GPU has it
    assert [p.label in clf.labels for p in clf.classify_texts(TICKETS)] == [True, True]
    (fallback,) = [r for r in caplog.records if r.getMessage() == "dtype_fallback"]
    assert (fallback.dtype, fallback.instead) == ("fp16", "fp32") and "not finite" in fallback.why


def test_the_bench_builds_the_dtype_the_worker_builds(out_of_fp16_range, tmp_path, auto_is_fp16):
    """The bench loads once and shares the model between its prompt variants: it kept fp16 (NaN on every ticket)
    while the worker fell back; the fallback is the loader's now."""
    s = settings(out_of_fp16_range, tmp_path)
    ((_, bench),) = build_classifiers(s, [("task", default_task())])
    assert bench.dtype_name == build_classifier(s).dtype_name == "fp32"
    assert all(p.label in bench.labels for p in bench.classify_texts(TICKETS))


def test_auto_keeps_fp16_on_a_model_within_its_range(tiny_model_dir, tmp_path, auto_is_fp16, caplog):
    with caplog.at_level(logging.WARNING, logger="triage.assemble"):
        clf = build_classifier(settings(tiny_model_dir, tmp_path))
    assert clf.dtype_name == "fp16" and "dtype_fallback" not in caplog.text
    assert all(p.label in clf.labels for p in clf.classify_texts(TICKETS))


def test_a_model_whose_outputs_are_never_finite_stops_the_start_saying_so(tiny_model_dir, tmp_path, auto_is_fp16):
    broken = edited_model(tiny_model_dir, tmp_path / "broken", lambda emb: emb.fill_(float("nan")))
    with pytest.raises(ValueError, match="not finite in fp32 either"):
        build_classifier(settings(broken, tmp_path))


def test_a_dtype_set_by_hand_is_kept_and_auto_is_unchanged_off_gpu(out_of_fp16_range, tmp_path):
    clf = build_classifier(settings(out_of_fp16_range, tmp_path, dtype="fp16"))  # no probe: the user's choice
    assert clf.dtype_name == "fp16"
    assert build_classifier(settings(out_of_fp16_range, tmp_path)).dtype_name in ("bf16", "fp32")  # CPU auto


def test_an_overflow_on_the_chat_format_alone_is_found(tiny_model_dir, tmp_path, auto_is_fp16):
    """Only ``<|im_start|>``'s embedding is out of range: no ticket holds it, every prompt does. The probe is in
    the chat format, so it is found at load (a bare sentence missed it, and the start-up warm-up then failed)."""
    from transformers import AutoTokenizer

    start = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("<|im_start|>")
    model = edited_model(tiny_model_dir, tmp_path / "sink", lambda emb: emb[start].mul_(1e6))
    with pytest.raises(NonFiniteScores):  # the premise: in fp16 every ticket's scores are NaN
        build_classifier(settings(model, tmp_path, dtype="fp16")).classify_texts(TICKETS)
    clf = build_classifier(settings(model, tmp_path))
    assert clf.dtype_name == "fp32" and all(p.label in clf.labels for p in clf.classify_texts(TICKETS))


def test_a_joined_encoder_that_falls_back_takes_the_lm_with_it(tiny_model_dir, tiny_bert_dir, tmp_path, auto_is_fp16):
    """TRIAGE_ENCODER beside the LM: each is probed, and where one falls back both serve in that dtype (one dtype
    names the classifier, its feature caches and the bench's Redis-mode worker)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_bert_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e6)  # inf in fp16; the embeddings' LayerNorm scales it back
    model.save_pretrained(tmp_path / "bert")
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(tmp_path / "bert")
    clf = build_classifier(settings(tiny_model_dir, tmp_path, encoder=str(tmp_path / "bert")))
    assert (clf.dtype_name, clf.encoder.model.dtype) == ("fp32", torch.float32)
    assert all(p.label in clf.labels for p in clf.classify_texts(TICKETS))
