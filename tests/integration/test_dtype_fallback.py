"""TRIAGE_DTYPE=auto picks fp16 on a GPU. A model whose numbers pass fp16's range (65,504) then scores every ticket
NaN, and every ticket would be dead-lettered: the builder probes one ticket and builds again in a safer dtype.

Real tiny models through real transformers code, in fp16 on the CPU; only auto's device rule is set to "fp16 here",
as it is on CUDA (auto never picks fp16 on a CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.assemble import build_classifier, safer_dtype
from worker.engine import device
from worker.engine.results import NonFiniteScores
from worker.settings import Settings

TICKETS = ["my card was charged twice", "the app crashes on login"]


@pytest.fixture
def auto_is_fp16(monkeypatch):
    real = device.pick_dtype
    monkeypatch.setattr(
        device, "pick_dtype", lambda d, requested="auto": torch.float16 if requested == "auto" else real(d, requested)
    )


@pytest.fixture(scope="module")
def out_of_fp16_range(tiny_model_dir, tmp_path_factory):
    """The tiny model with its embeddings 10^6 times larger: most are over 65,504 (inf in fp16), all fine in
    bf16 and fp32 (the first norm scales them back)."""
    path = tmp_path_factory.mktemp("out-of-fp16-range")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.clone())
        model.get_input_embeddings().weight.mul_(1e6)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def settings(model, tmp_path, **kw) -> Settings:
    return Settings(model=str(model), device="cpu", cache_dir=str(tmp_path), **kw)


def test_auto_builds_again_in_a_safer_dtype_when_fp16_overflows(out_of_fp16_range, tmp_path, auto_is_fp16, caplog):
    with pytest.raises(NonFiniteScores):  # the premise: fp16 set by hand overflows on this model
        build_classifier(settings(out_of_fp16_range, tmp_path, dtype="fp16")).classify_texts(TICKETS)
    with caplog.at_level(logging.WARNING, logger="triage.assemble"):
        clf = build_classifier(settings(out_of_fp16_range, tmp_path))
    assert clf.dtype_name == safer_dtype("cpu") == "fp32"
    assert [p.label in clf.labels for p in clf.classify_texts(TICKETS)] == [True, True]
    (fallback,) = [r for r in caplog.records if r.getMessage() == "dtype_fallback"]
    assert (fallback.dtype, fallback.instead) == ("fp16", "fp32") and "not finite" in fallback.why


def test_auto_keeps_fp16_on_a_model_within_its_range(tiny_model_dir, tmp_path, auto_is_fp16, caplog):
    with caplog.at_level(logging.WARNING, logger="triage.assemble"):
        clf = build_classifier(settings(tiny_model_dir, tmp_path))
    assert clf.dtype_name == "fp16" and "dtype_fallback" not in caplog.text
    assert all(p.label in clf.labels for p in clf.classify_texts(TICKETS))


def test_a_dtype_set_by_hand_is_kept_and_auto_is_unchanged_off_gpu(out_of_fp16_range, tmp_path):
    clf = build_classifier(settings(out_of_fp16_range, tmp_path, dtype="fp16"))  # no probe: the user's choice
    assert clf.dtype_name == "fp16"
    assert build_classifier(settings(out_of_fp16_range, tmp_path)).dtype_name in ("bf16", "fp32")  # CPU auto
