"""`triage-worker eval` and `triage-worker fit` end to end on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.assemble import build_classifier
from worker.cli import main
from worker.engine.task import default_task, load_task_file
from worker.quality import data as quality_data
from worker.quality.head import Head, HeadMismatch
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TICKETS = ROOT / "tests" / "data" / "support_tickets_labelled.jsonl"


@pytest.fixture
def tiny_env(tiny_model_dir, tmp_path, monkeypatch) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIAGE_")}
    env.update(
        TRIAGE_MODEL=str(tiny_model_dir),
        TRIAGE_DEVICE="cpu",
        TRIAGE_DTYPE="fp32",
        TRIAGE_CACHE_DIR=str(tmp_path / "cache"),
        TRIAGE_LOG_FORMAT="json",
        HF_HUB_OFFLINE="1",
    )
    for k in [k for k in os.environ if k.startswith("TRIAGE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        if k.startswith("TRIAGE_"):
            monkeypatch.setenv(k, v)
    return env


def test_eval_command_reports_metrics_for_every_variant_and_writes_a_png(tiny_env, tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "cm.png"
    rc = main(
        [
            "eval",
            "--input",
            str(TICKETS),
            "--split",
            "test",
            "--limit",
            "15",
            "--train",
            str(TICKETS),
            "--train-split",
            "train",
            "--k",
            "1",
            "--head-shots",
            "1",
            "--curve-repeats",
            "2",
            "--pooling",
            "mean",
            "--calibration",
            "none,contextual,prior",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["n_test"] == 15 and report["n_train"] == 50 and report["model"] == tiny_env["TRIAGE_MODEL"]
    names = {m["name"] for m in report["methods"]}
    for want in (
        "zero-shot",
        "descriptions +contextual",
        "few-shot +prior",
        "task",
        "head logreg/mean",
        "head centroid/mean",
        "head on task examples logreg/mean",
    ):
        assert want in names, names
    for m in report["methods"]:
        assert 0.0 <= m["accuracy"] <= 1.0 and 0.0 <= m["ece"] <= 1.0
        assert sum(map(sum, m["confusion"])) == 15
        assert set(m["per_label"]) == {"billing", "technical", "account", "shipping", "other"}
    assert report["passes"]["few-shot"]["examples"] == 5 and report["learning_curve"][0]["per_label"] == 1
    assert report["worker_default"] == "head on task examples centroid/mean"  # TRIAGE_SCORER=auto, built-in task
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = capsys.readouterr().out
    assert "best:" in stdout and "head logreg/mean" in stdout


def test_eval_command_line_runs_in_a_fresh_process(tiny_env, tmp_path):
    """The installed entry point, as on a fresh clone (one cheap variant)."""
    out = tmp_path / "eval.json"
    cmd = [
        sys.executable,
        "-m",
        "worker",
        "eval",
        "--input",
        str(TICKETS),
        "--split",
        "test",
        "--limit",
        "5",
        "--variants",
        "zero-shot",
        "--calibration",
        "none",
        "--json",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=tiny_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["name"] for m in json.loads(out.read_text())["methods"]] == ["zero-shot"]


def test_eval_rejects_missing_files_and_unknown_labels(tiny_env, tmp_path, capsys, monkeypatch):
    assert main(["eval", "--input", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello", "label": "greeting"}\n')
    monkeypatch.setenv("TRIAGE_LABELS", "billing,other")
    assert main(["eval", "--input", str(data)]) == 2
    assert "labels the task does not know: ['greeting']" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"not a head at all", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"])
def test_eval_refuses_a_head_file_it_cannot_load_before_the_model_loads(tiny_env, tmp_path, capsys, content):
    """``--head`` (or TRIAGE_HEAD_PATH) naming a corrupt or foreign file ended in a traceback (exit 1), and only after
    the test pass: minutes on real data. The worker and verify say it in one line."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "I was charged twice", "label": "billing"}\n')
    bad = tmp_path / "head.safetensors"
    bad.write_bytes(content)
    assert main(["eval", "--input", str(data), "--head", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eval: cannot load scorer head {bad}") and "Traceback" not in err, err


def test_eval_on_a_sample_lacking_a_label_scores_the_configured_task_whole(tiny_env, tmp_path, capsys):
    """A small --limit (no 'shipping' ticket in it) still measures the worker's task: its 5 labels, descriptions
    and examples, and the head the worker fits on them at start-up -- not a 4-label task without either."""
    sample = quality_data.subsample(quality_data.load_labelled(TICKETS, split="test"), 10, 0)
    assert "shipping" not in {r.label for r in sample}  # the premise
    out = tmp_path / "eval.json"
    args = ["eval", "--input", str(TICKETS), "--split", "test", "--limit", "10", "--variants", "task,head"]
    args += ["--calibration", "none", "--pooling", "mean", "--head-methods", "centroid", "--no-progress"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    task = default_task()
    assert report["labels"] == list(task.labels) and report["n_test"] == 10
    assert report["passes"]["task"]["examples"] == len(task.examples) > 0
    assert report["worker_default"] == "head on task examples centroid/mean"  # measured: the worker's own scorer
    for m in report["methods"]:
        assert set(m["per_label"]) == set(task.labels) and sum(map(sum, m["confusion"])) == 10
    assert "worker default: head on task examples centroid/mean" in capsys.readouterr().out


def test_eval_names_the_worker_default_only_when_exactly_that_was_measured(tiny_env, tmp_path, capsys, monkeypatch):
    """TRIAGE_SCORER=prompt runs the task uncalibrated: 'task', never 'task +prior' because it was listed first;
    with TRIAGE_CALIBRATION=contextual 'task +contextual'; when the run left it out, not measured."""
    monkeypatch.setenv("TRIAGE_SCORER", "prompt")
    out = tmp_path / "eval.json"
    base = ["eval", "--input", str(TICKETS), "--split", "test", "--limit", "5", "--variants", "task", "--no-progress"]
    base += ["--cache-dir", str(tmp_path / "passes"), "--json", str(out)]

    def default(calibrations: str) -> str | None:
        assert main([*base, "--calibration", calibrations]) == 0
        report = json.loads(out.read_text())
        assert {m["name"] for m in report["methods"]} >= {"task +prior"}
        return report["worker_default"]

    assert default("prior,none,contextual") == "task"
    monkeypatch.setenv("TRIAGE_CALIBRATION", "contextual")
    assert default("prior,none,contextual") == "task +contextual"
    capsys.readouterr()
    assert default("prior,none") is None  # the worker's contextual calibration was not in this run
    stdout = capsys.readouterr().out
    assert "worker default: not measured (the worker runs prompt 'task', calibration contextual)" in stdout
    assert json.loads(out.read_text())["worker_runs"] == "prompt 'task', calibration contextual"


def test_fit_and_eval_refuse_training_data_without_a_task_label_in_one_line(tiny_env, tmp_path, capsys):
    """A head needs a ticket per label of the task: fit and eval say which are missing and exit 2 (no traceback),
    before loading the model; with --fine-labels, a coarse label no fine label maps to."""
    no_shipping = tmp_path / "no_shipping.jsonl"
    lines = [line for line in TICKETS.read_text().splitlines() if '"shipping"' not in line]
    no_shipping.write_text("\n".join(lines) + "\n")
    assert main(["fit", "--input", str(no_shipping), "--split", "train", "--out", str(tmp_path / "h.safetensors")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("fit: ") and err.count("\n") == 1 and "has no tickets for the task's labels ['shipping']" in err
    )
    assert not (tmp_path / "h.safetensors").exists()
    args = ["eval", "--input", str(TICKETS), "--split", "test", "--train", str(no_shipping), "--train-split", "train"]
    assert main([*args, "--variants", "head", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval: --train ") and err.count("\n") == 1 and "labels ['shipping']" in err
    # fine labels: no intent maps to 'shipping'
    fine, mapping = _fine_files(tmp_path)
    fine.write_text("\n".join(line for line in fine.read_text().splitlines() if "lost_parcel" not in line))
    fit = ["fit", "--input", str(fine), "--label-map", str(mapping), "--fine-labels", "--out", str(tmp_path / "f.st")]
    assert main([*fit, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fit: ") and err.count("\n") == 1 and "['shipping']" in err
    args = ["eval", "--input", str(fine), "--train", str(fine), "--label-map", str(mapping), "--fine-labels"]
    assert main([*args, "--variants", "head", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval: ") and err.count("\n") == 1 and "['shipping']" in err


def test_eval_and_fit_refuse_a_row_whose_text_is_not_a_string(tiny_env, tmp_path, capsys):
    """Named by the line an editor shows (``file:3``): it said "row 2", which a blank line put on another line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "refund please", "label": "billing"}\n\n{"text": null, "label": "other"}\n')
    assert main(["eval", "--input", str(bad), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"eval: {bad}:3: 'text' must be a string, got null\n"
    assert main(["fit", "--input", str(bad), "--out", str(tmp_path / "h.safetensors")]) == 2
    assert capsys.readouterr().err == f"fit: {bad}:3: 'text' must be a string, got null\n"


def test_verify_refuses_an_object_id_naming_its_line_before_loading_the_model(tiny_env, tmp_path, capsys):
    """It was ``str()``-ed into the id "{'a': 1}"; a file that is no JSON Lines ended in a traceback."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "T-1", "text": "refund please"}\n\n{"id": {"a": 1}, "text": "app crashes"}\n')
    assert main(["verify", "--input", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f"triage-worker verify: {bad}:3: ticket 2 of the file: id must be a string or a finite number, got a dict "
        "(a JSON object): {'a': 1}\n"
    )
    bad.write_text('{"text": "refund please"}\n{"text": \n')
    assert main(["verify", "--input", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"triage-worker verify: {bad}:2: not valid JSON")


def test_verify_skips_a_text_that_is_no_string_as_the_worker_dead_letters_it(tiny_env, tmp_path):
    """`"text": null` / `42` / `["x"]` were verified as the tickets "None", "42" and "['x']", which no worker
    classifies (it dead-letters them): they are skipped as invalid, like any other invalid ticket."""
    rows = tmp_path / "rows.jsonl"
    texts = [None, 42, ["x"], "refund please", "the app crashes"]
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "verify.json"
    assert main(["verify", "--input", str(rows), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["skipped_invalid"] == 3 and report["n"] == 2


def test_fit_writes_task_file_and_a_head_the_worker_loads(tiny_env, tmp_path, capsys, monkeypatch):
    head_path, task_path = tmp_path / "head.safetensors", tmp_path / "task.yaml"
    rc = main(
        [
            "fit",
            "--input",
            str(TICKETS),
            "--split",
            "train",
            "--out",
            str(head_path),
            "--examples-out",
            str(task_path),
            "--k",
            "1",
            "--method",
            "centroid",
            "--no-progress",
        ]
    )
    assert rc == 0
    hint = capsys.readouterr().out.rsplit("run the worker with: ", 1)[1]
    # every setting the head is tied to that is not the default (the model here): the hint named the head alone
    assert hint.startswith(f"TRIAGE_HEAD_PATH={head_path} TRIAGE_TASK_FILE={task_path} TRIAGE_MODEL="), hint
    umask = os.umask(0)
    os.umask(umask)
    assert head_path.stat().st_mode & 0o777 == 0o666 & ~umask  # safetensors wrote 0600
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    task = load_task_file(task_path)
    assert len(task.examples) == 5 and {e.label for e in task.examples} == set(task.labels)
    head = Head.load(head_path)
    assert head.method == "centroid" and head.meta["n_train"] == 50
    clf = build_classifier(Settings(task_file=task_path, head_path=head_path))
    assert clf.scorer.kind == "head"
    preds = clf.classify_texts(["I was charged twice", "the app crashes"])
    assert all(p.label in task.labels for p in preds)
    # the default head prompt holds the instructions and label names only: the task file's examples do not change it
    assert (
        head.meta["head_prompt"] == "labels" and build_classifier(Settings(head_path=head_path)).scorer.kind == "head"
    )
    full = tmp_path / "full.safetensors"  # fitted under the whole task prompt, examples included
    assert (
        main(
            [
                "fit",
                "--input",
                str(TICKETS),
                "--split",
                "train",
                "--out",
                str(full),
                "--head-prompt",
                "task",
                "--examples-out",
                str(task_path),
                "--k",
                "1",
                "--method",
                "centroid",
                "--no-progress",
            ]
        )
        == 0
    )
    assert build_classifier(Settings(task_file=task_path, head_path=full, head_prompt="task")).scorer.kind == "head"
    with pytest.raises(HeadMismatch, match="prompt"):  # same labels, but without the examples it was fitted under
        build_classifier(Settings(head_path=full, head_prompt="task"))
    with pytest.raises(HeadMismatch, match="'task' prompt"):  # fitted under the whole task, run under labels only
        build_classifier(Settings(task_file=task_path, head_path=full))
    # eval scores the head file under the task it was fitted for, and names it the worker's default
    monkeypatch.setenv("TRIAGE_TASK_FILE", str(task_path))
    monkeypatch.setenv("TRIAGE_HEAD_PATH", str(head_path))
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "--input",
                str(TICKETS),
                "--split",
                "test",
                "--limit",
                "5",
                "--variants",
                "head",
                "--pooling",
                "mean",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["worker_default"] == "head file centroid/mean"
    assert {m["name"] for m in report["methods"]} >= {"head file centroid/mean", "head on task examples centroid/mean"}


def test_fit_refuses_an_output_it_cannot_write_before_the_model_loads(tiny_env, tmp_path, capsys):
    """``--out`` a directory, or in a folder that cannot be made: a traceback after the forward pass and the fit."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, words in ((tmp_path, "is a directory"), (blocker / "head.safetensors", "cannot create its folder")):
        assert main(["fit", "--input", str(TICKETS), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fit: --out {out}") and words in err and "Traceback" not in err, err


def test_fit_refuses_unknown_labels_and_empty_requests(tiny_env, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello", "label": "greeting"}\n{"text": "pay", "label": "billing"}\n')
    assert main(["fit", "--input", str(data), "--out", str(tmp_path / "h.safetensors")]) == 2
    assert "labels the configured task does not know" in capsys.readouterr().err
    assert main(["fit", "--input", str(data)]) == 2


FINE_MAP = {
    "billing": ["refund", "invoice"],
    "technical": ["crash", "error_page"],
    "account": ["password"],
    "shipping": ["lost_parcel"],
}
FINE_TEXTS = {
    "refund": ["refund my order please", "I want my money back"],
    "invoice": ["the invoice VAT is wrong", "send me a copy of the invoice"],
    "crash": ["the app crashes at start", "it crashed again"],
    "error_page": ["error 500 on save", "I see an error page"],
    "password": ["reset my password", "cannot log in"],
    "lost_parcel": ["my parcel is lost", "package never arrived"],
    "other": ["do you have jobs?", "great product"],  # unmapped: answers as itself
}


def _fine_files(tmp_path: Path) -> tuple[Path, Path]:
    """7 fine labels in a labelled file, and a map folding them into the built-in task's 5 labels."""
    data = tmp_path / "fine.jsonl"
    data.write_text("\n".join(json.dumps({"text": t, "label": lab}) for lab, ts in FINE_TEXTS.items() for t in ts))
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps(FINE_MAP))
    return data, mapping


def test_fit_fine_labels_gives_a_head_the_worker_runs_in_the_task_labels(tiny_env, tmp_path, capsys):
    texts = FINE_TEXTS
    data, mapping = _fine_files(tmp_path)
    head_path = tmp_path / "fine.safetensors"
    args = ["fit", "--input", str(data), "--label-map", str(mapping), "--out", str(head_path), "--no-progress"]
    assert main([*args, "--fine-labels"]) == 0
    assert "7 fine labels summed into 5" in capsys.readouterr().out
    head = Head.load(head_path)
    assert set(head.labels) == set(texts) and head.meta["groups"]["crash"] == "technical"
    clf = build_classifier(Settings(head_path=head_path))
    assert clf.scorer.kind == "head" and clf.scorer.names == clf.labels  # answers in the built-in task's labels
    items = clf.prepare_valid([t for ts in texts.values() for t in ts] + ["a much longer ticket " * 10])
    batched, _ = clf.classify(items)
    reference = clf.reference(items)
    assert [p.label for p in batched] == [p.label for p in reference]
    assert all(set(p.scores) == set(clf.labels) and sum(p.scores.values()) == pytest.approx(1.0) for p in batched)
    for a, b in zip(batched, reference):
        assert a.scores == pytest.approx(b.scores, abs=1e-4)
    # without a map there is nothing to sum into: one line, exit 2
    assert main([*args[:3], "--out", str(head_path), "--fine-labels"]) == 2
    assert "--fine-labels needs a label map" in capsys.readouterr().err


def test_eval_fine_labels_fits_the_head_as_fit_does_and_scores_it_in_the_mapped_labels(tiny_env, tmp_path, capsys):
    data, mapping = _fine_files(tmp_path)
    head_path, out, md = tmp_path / "fine.safetensors", tmp_path / "eval.json", tmp_path / "eval.md"
    fit = ["fit", "--input", str(data), "--label-map", str(mapping), "--fine-labels", "--out", str(head_path)]
    assert main([*fit, "--no-progress"]) == 0
    capsys.readouterr()
    test = tmp_path / "fine_test.jsonl"  # the same tickets in another file (eval refuses --train == --input)
    test.write_text("\n".join(reversed(data.read_text().splitlines())) + "\n")
    args = ["eval", "--input", str(test), "--train", str(data), "--label-map", str(mapping), "--no-progress"]
    args += ["--variants", "head", "--pooling", "mean", "--head-shots", "1", "--curve-repeats", "1"]
    rc = main([*args, "--fine-labels", "--head", str(head_path), "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    report = json.loads(out.read_text())
    coarse = {"billing", "technical", "account", "shipping", "other"}
    assert report["fine_labels"] == {"fine": 7, "summed_into": 5} and set(report["labels"]) == coarse
    rows = {m["name"]: m for m in report["methods"]}
    fitted = rows["head on 7 fine labels logreg/mean"]
    assert "head on 7 fine labels centroid/mean" in rows and fitted["fine_labels"] == 7
    for m in rows.values():  # every score is over the mapped labels, one row per test ticket
        assert set(m["per_label"]) == coarse and sum(map(sum, m["confusion"])) == sum(map(len, FINE_TEXTS.values()))
    # the same head `fit --fine-labels` writes: the same scores as that file's
    from_file = rows["head file logreg/mean"]
    assert fitted["accuracy"] == from_file["accuracy"] and fitted["ece"] == pytest.approx(from_file["ece"], abs=1e-4)
    assert report["learning_curve"][0]["per_label"] == 1  # one ticket per fine label: every fine label present
    stdout = capsys.readouterr().out
    assert "heads fitted on 7 fine labels summed into 5" in stdout and "1/fine label" in stdout
    assert "7 fine labels summed into 5" in md.read_text()
    # without a map there is nothing to sum into: one line, exit 2 (as fit), before any model is loaded
    assert main(["eval", "--input", str(data), "--train", str(data), "--fine-labels"]) == 2
    err = capsys.readouterr().err
    assert err == "eval: --fine-labels needs a label map (--label-map, or a named set like clinc150-domains)\n"


def test_eval_marks_a_head_scored_on_its_own_training_rows_and_refuses_train_equal_to_test(tiny_env, tmp_path, capsys):
    """A head file records the rows `fit` fitted it on; eval on those rows marks it "(seen in fit)" and never names
    it best (the shipped head on the support test split it was fitted on was reported best at accuracy 1.0). A
    --train that holds the test rows is refused."""
    head = tmp_path / "head.safetensors"
    fit = ["fit", "--input", str(TICKETS), "--split", "train", "--out", str(head), "--method", "centroid"]
    assert main([*fit, "--no-progress"]) == 0
    assert Head.load(head).meta["data"][0]["fitted_splits"] == ["train"]
    out = tmp_path / "eval.json"
    base = ["eval", "--input", str(TICKETS), "--limit", "6", "--variants", "task,head", "--calibration", "none"]
    base += ["--pooling", "mean", "--head", str(head), "--json", str(out), "--no-progress"]
    for split, seen in (("train", True), ("test", False)):
        assert main([*base, "--split", split]) == 0
        report = json.loads(out.read_text())
        (scored,) = [m for m in report["methods"] if m.get("head_file") == str(head)]
        assert scored.get("seen_in_fit", False) is seen and scored["name"].endswith("(seen in fit)") is seen
        assert report["best"] != scored["name"] or not seen
    capsys.readouterr()
    same = ["eval", "--input", str(TICKETS), "--split", "test", "--train", str(TICKETS), "--no-progress"]
    assert main(same) == 2
    assert "holds the test rows" in capsys.readouterr().err
    assert main([*same, "--train-split", "train", "--limit", "4", "--variants", "task", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["train_test_same_text"] == 0
