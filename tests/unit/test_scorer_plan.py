"""The one scorer rule (``worker.scorer_plan``): what the builder, preflight and eval's ``worker_default`` share."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine.task import Example, Task, default_task
from worker.heads import shipped_head_path
from worker.scorer_plan import ScoringConfigError, plan_scorer

HEAD = Path("/heads/fitted.safetensors")


def _task(examples: bool) -> Task:
    shown = (Example("refund", "billing"), Example("crash", "technical")) if examples else ()
    return Task(labels=("billing", "technical"), examples=shown, instructions="Classify.")


@pytest.mark.parametrize(
    "scorer, head, examples, kind",
    [
        ("prompt", HEAD, True, "prompt"),  # a head file is ignored under prompt (the builder warns)
        ("head", HEAD, False, "head_file"),
        ("auto", HEAD, False, "head_file"),
        ("auto", None, True, "task_examples"),
        ("auto", None, False, "prompt"),
    ],
)
def test_the_rule(scorer, head, examples, kind):
    plan = plan_scorer(scorer, head, "/models/lm", _task(examples))
    assert plan.kind == kind and (plan.path == HEAD) == (kind == "head_file"), plan
    if kind == "prompt" and scorer == "auto":
        assert plan.missing_examples == ("billing", "technical")


def test_a_shipped_head_comes_before_the_task_examples_and_falls_back_to_them():
    plan = plan_scorer("auto", None, "bundled:smollm2", default_task())
    assert plan.kind == "shipped_head" and plan.path == shipped_head_path("bundled:smollm2")
    assert plan.fallback is not None and plan.fallback.kind == "task_examples"


def test_an_encoder_without_examples_may_still_use_the_shipped_head_but_not_fall_back_to_prompt():
    no_examples = default_task(with_examples=False)
    plan = plan_scorer("auto", None, "bundled:minilm", no_examples, needs_head=True)
    assert plan.kind == "shipped_head" and plan.fallback.kind == "unscorable"
    assert "needs a head" in str(plan.fallback.error())
    with pytest.raises(ScoringConfigError, match="none for") as e:
        plan_scorer("auto", None, "/models/bert", _task(False), needs_head=True)
    assert e.value.setting == "TRIAGE_HEAD_PATH"


@pytest.mark.parametrize(
    "scorer, needs_head, setting, words",
    [
        ("head", False, "TRIAGE_HEAD_PATH", "TRIAGE_SCORER=head needs it"),
        ("prompt", True, "TRIAGE_SCORER", "label tokens, which /models/bert lacks"),
    ],
)
def test_settings_no_model_can_start_with_name_the_setting(scorer, needs_head, setting, words):
    with pytest.raises(ScoringConfigError) as e:
        plan_scorer(scorer, None, "/models/bert", _task(True), needs_head=needs_head)
    assert e.value.setting == setting and words in str(e.value) and str(e.value).startswith(f"{setting}: ")


def test_eval_names_the_scorer_the_builder_falls_back_to_and_settings_no_worker_starts_with():
    """eval's ``worker_default`` follows the builder: a shipped head that does not fit the head prompt falls back
    (it named the shipped head, 'not measured', while the worker ran the task-examples head), and an encoder under
    TRIAGE_SCORER=prompt starts no worker (it named prompt scoring)."""
    from worker.quality.worker_default import describe_method, worker_default
    from worker.settings import Settings

    lm = Settings(model="bundled:smollm2", scorer="auto", head_path=None)
    shipped = {"method": "head", "head_file": str(shipped_head_path("bundled:smollm2"))}
    assert worker_default(lm, default_task(), None, fits=lambda path: True) == shipped
    fallback = worker_default(lm, default_task(), None, fits=lambda path: False)
    assert fallback == {"method": "head", "name": "head on task examples centroid/mean"}
    encoder = Settings(model="bundled:minilm", scorer="prompt", head_path=None)
    none = worker_default(encoder, default_task(), None, needs_head=True)
    assert none["method"] == "none" and "TRIAGE_SCORER" in describe_method(none)
    no_examples = worker_default(
        Settings(model="/models/bert", scorer="auto", head_path=None), _task(False), None, needs_head=True
    )
    assert no_examples["method"] == "none" and "needs a head" in no_examples["unstartable"]
