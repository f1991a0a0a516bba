"""One builder: the bench builds exactly the worker's classifier (tiny model), and the old setting names still work."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_architecture import _settings_from_env


def _engine_view(clf) -> tuple:
    return clf.options, clf.scorer.kind, getattr(clf.scorer, "source", None), tuple(np.round(clf.score_bias, 12))


@pytest.mark.parametrize("variant", ["prompt_calibrated", "auto", "head_file"])
def test_bench_classifier_is_the_workers_classifier(variant, tiny_model_dir, tmp_path, monkeypatch):
    import torch

    from worker.assemble import build_classifier, features_classifier, fit_head_on_task_examples, task_from_settings
    from worker.bench import cli
    from worker.settings import Settings

    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this test process as it is
    env = {
        "TRIAGE_MODEL": str(tiny_model_dir),
        "TRIAGE_DEVICE": "cpu",
        "TRIAGE_DTYPE": "fp32",
        "TRIAGE_CACHE_DIR": str(tmp_path),
        "TRIAGE_PREFIX_CACHE": "false",
        "TRIAGE_PASS_MAX_ITEMS": "3",
        "TRIAGE_PASS_MAX_TOKENS": "700",
        "TRIAGE_PASS_OVERHEAD_TOKENS": "5",
        "TRIAGE_CONFIDENCE_THRESHOLD": "0.3",
        "TRIAGE_MAX_INPUT_TOKENS": "40",
    }
    if variant == "prompt_calibrated":
        env |= {"TRIAGE_SCORER": "prompt", "TRIAGE_CALIBRATION": "contextual"}
    elif variant == "head_file":
        prompt = features_classifier(
            Settings(model=str(tiny_model_dir), device="cpu", dtype="fp32", cache_dir=tmp_path, prefix_cache=False)
        )  # the states a head reads (TRIAGE_HEAD_PROMPT)
        fit_head_on_task_examples(prompt).save(tmp_path / "head.safetensors")
        env |= {"TRIAGE_SCORER": "head", "TRIAGE_HEAD_PATH": str(tmp_path / "head.safetensors")}
    worker_settings = _settings_from_env(monkeypatch, env)
    worker = build_classifier(worker_settings)
    args = cli.build_parser().parse_args([])  # no --threads: the worker's own TRIAGE_TORCH_THREADS
    bench_settings = cli.bench_settings(args)
    assert bench_settings.model_dump() == worker_settings.model_dump()
    ((_, bench),) = cli.build_classifiers(bench_settings, [("few-shot", task_from_settings(bench_settings))])
    assert _engine_view(bench) == _engine_view(worker)
    expected_kind = {"prompt_calibrated": "prompt", "auto": "head", "head_file": "head"}[variant]
    assert worker.scorer.kind == expected_kind
    assert not worker.options.prefix_cache and worker.options.pass_overhead_tokens == 5
    if variant == "prompt_calibrated":
        assert np.abs(worker.score_bias).max() > 0
    assert torch.get_num_threads() == threads


def test_auto_pass_overhead_is_measured_on_the_classifier_that_serves(tiny_model_dir, tmp_path, monkeypatch):
    """TRIAGE_PASS_OVERHEAD_TOKENS=auto: the builder times the passes of the classifier it returns, scorer
    included, and the planner prices passes with what it measured; the default, a number, is used as it is."""
    from worker.assemble import build_classifier
    from worker.engine import bucketing, overhead
    from worker.settings import Settings

    timed = []
    real_measure = overhead.measure
    monkeypatch.setattr(overhead, "measure", lambda clf: timed.append(clf) or real_measure(clf))
    s = Settings(model=str(tiny_model_dir), device="cpu", dtype="fp32", cache_dir=tmp_path, pass_max_tokens=900)
    assert s.pass_overhead_tokens == 32 and build_classifier(s).options.pass_overhead_tokens == 32 and not timed
    s = s.model_copy(update={"pass_overhead_tokens": "auto"})
    clf = build_classifier(s)
    assert timed == [clf] and clf.scorer.kind == "head"  # the one that serves: the head fitted at start-up
    measured = clf.options.pass_overhead_tokens
    assert isinstance(measured, int) and 0 <= measured <= 900
    items = clf.prepare_valid([f"ticket {i} " + "word " * (i % 13) for i in range(40)])
    lengths = [clf.cost_length(p) for p in items]
    assert clf.plan(items) == bucketing.plan_passes(lengths, 64, 900, measured)


# ------------------------------------------------------------ deprecated setting names
def test_old_batch_settings_still_work_and_warn_once(monkeypatch, tiny_model_dir, tmp_path, caplog):
    import logging

    from worker import assemble
    from worker.settings import Settings

    monkeypatch.setattr(assemble, "_warned", set())
    monkeypatch.setenv("TRIAGE_MAX_BATCH_ITEMS", "8")
    monkeypatch.setenv("TRIAGE_MAX_BATCH_TOKENS", "300")
    monkeypatch.setenv("TRIAGE_BATCH_OVERHEAD_TOKENS", "4")
    s = Settings()
    assert (s.window_max_items, s.pass_max_items, s.pass_max_tokens, s.pass_overhead_tokens) == (8, 8, 300, 4)
    monkeypatch.setenv("TRIAGE_PASS_MAX_ITEMS", "2")  # a new name wins over the old one
    s = Settings(model=str(tiny_model_dir), device="cpu", dtype="fp32", cache_dir=tmp_path, scorer="prompt")
    assert (s.window_max_items, s.pass_max_items) == (8, 2)
    with caplog.at_level(logging.WARNING, logger="triage.assemble"):
        clf = assemble.build_classifier(s)
        assemble.build_classifier(s, loaded=clf.loaded)
    warned = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warned) == 3 and sum("TRIAGE_MAX_BATCH_ITEMS" in w for w in warned) == 1, warned
    o = clf.options
    assert (o.pass_max_items, o.pass_max_tokens, o.pass_overhead_tokens) == (2, 300, 4)
