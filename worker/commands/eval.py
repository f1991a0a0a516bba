"""Measure label quality on a labelled file: accuracy, macro-F1, per-label precision/recall,
calibration (ECE), coverage at confidence thresholds, and a confusion-matrix PNG.

Compares in one run: prompt variants (zero-shot, label descriptions, few-shot k per label,
the task as configured), each raw and with contextual / prior calibration, and -- when
--train is given -- a scorer head (logistic regression / nearest centroid, mean / last-token
pooling) fitted on the training tickets (with --fine-labels: on their labels before the
--label-map, each mapped label the sum of its fine labels', as `fit --fine-labels`).
Settings (model, dtype, task, batch sizes) come from TRIAGE_* as for the worker.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker.commands.arg_types import at_least
from worker.commands.model_flags import add_model_arguments, settings_from_args

NAME = "eval"
HELP = "measure accuracy / macro-F1 / calibration of prompt variants and a fitted head on labelled tickets"


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        required=True,
        help="labelled JSONL/CSV (text, label), or a named set: clinc150-domains, banking77, ... (test split unless "
        "named, e.g. banking77:val)",
    )
    p.add_argument(
        "--split", default=None, help="only rows of --input whose 'split' field equals this (a named set: its file)"
    )
    p.add_argument(
        "--train",
        default=None,
        help="labelled training file or named set, its train split unless named (few-shot examples and the head)",
    )
    p.add_argument(
        "--train-split", default=None, help="only rows of --train whose 'split' field equals this (named set: its file)"
    )
    p.add_argument(
        "--label-map", type=Path, default=None, help="JSON {coarse: [fine, ...]} applied to both files' labels"
    )
    p.add_argument(
        "--fine-labels",
        action="store_true",
        help="fit the head on --train's labels before the map (e.g. CLINC150's 150 intents), each mapped label the "
        "sum of its fine labels' probabilities, as `fit --fine-labels` (needs --label-map or a named set with one: "
        "clinc150-domains); prompt variants and all scores stay in the mapped labels",
    )
    p.add_argument("--limit", type=at_least(1), default=None, help="score a seeded random sample of N test tickets")
    p.add_argument(
        "--train-per-label",
        type=int,
        default=None,
        help="use a seeded sample of N training tickets per label (per fine label with --fine-labels)",
    )
    p.add_argument(
        "--variants",
        type=_csv,
        default=["zero-shot", "descriptions", "few-shot", "task", "head"],
        help="comma list of zero-shot,descriptions,few-shot,task,head (default: all)",
    )
    p.add_argument("--k", type=int, default=2, help="few-shot examples per label (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--calibration", type=_csv, default=["none", "contextual", "prior"], help="comma list of none,contextual,prior"
    )
    p.add_argument("--head-methods", type=_csv, default=["logreg", "centroid"])
    p.add_argument("--pooling", type=_csv, default=["mean", "last"])
    p.add_argument(
        "--head-shots",
        type=lambda v: [int(x) for x in _csv(v)],
        default=[],
        help="learning curve: also fit heads on N training tickets per label, e.g. 1,2,4,8",
    )
    p.add_argument("--curve-repeats", type=int, default=3, help="seeded resamples per learning-curve point")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="cache forward-pass results here (.npz) for fast re-runs"
    )
    p.add_argument("--head", type=Path, default=None, help="also score this fitted head (default: TRIAGE_HEAD_PATH)")
    p.add_argument("--max-prompt-labels", type=int, default=30, help="above this many labels only the head is measured")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write the full report here")
    p.add_argument("--markdown", type=Path, default=None, help="write the results table as Markdown here")
    p.add_argument("--plot", type=Path, default=None, help="write confusion matrices (PNG) here")
    add_model_arguments(p)
    p.add_argument("--no-progress", action="store_true")


def _loadable_head(path: Path) -> None:
    """A ``ValueError`` (exit 2) for a head file that cannot be read: corrupt, of a newer format, not a head."""
    from worker.quality.head import Head

    try:
        Head.load(path)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for corrupt files
        raise ValueError(f"cannot load scorer head {path}: {type(e).__name__}: {e}") from None


def run(args: argparse.Namespace) -> int:
    import time

    from worker.assemble import backbones
    from worker.quality import data, evaluation
    from worker.quality.fewshot import pick_examples

    settings = settings_from_args(args)
    t_start = time.perf_counter()
    try:
        test_src = data.resolve(args.input, args.label_map, args.split)
        train_src = (
            data.resolve(args.train, args.label_map, args.train_split, default_split="train") if args.train else None
        )
        test = data.subsample(test_src.rows, args.limit, args.seed)
        groups = None
        if args.fine_labels:  # the heads learn the fine labels (evaluation.EvalConfig.groups), as `fit --fine-labels`
            if not (train_src or test_src).label_map:
                raise ValueError("--fine-labels needs a label map (--label-map, or a named set like clinc150-domains)")
            if train_src is None:
                raise ValueError("--fine-labels fits the head on --train's fine labels: give --train")
            groups = train_src.groups()
        train = (train_src.fine_rows if groups else train_src.rows) if train_src else None
        if train and args.train_per_label:
            train = [
                data.Labelled(e.text, e.label)
                for e in pick_examples(train, args.train_per_label, args.seed, max_chars=None)
            ]
        base, descriptions = _base_task(settings, test, train_src.rows if train_src else None, test_src)
        if train and "head" in args.variants:  # heads are fitted on --train: every label needs a ticket
            coarse = [data.Labelled(r.text, groups[r.label]) for r in train] if groups else train
            data.require_every_label(base.labels, coarse, f"--train {train_src.description}")
        head_file = args.head or settings.head_path
        if head_file is not None:  # before the model loads and the test pass runs (minutes), not a traceback after
            _loadable_head(head_file)
        if train_src and data.seen_in_fit([data.provenance(train_src)], test_src):
            raise ValueError(
                f"--train {train_src.description} holds the test rows ({test_src.description}): every head and "
                "few-shot pick would be scored on tickets it was fitted on; give --split / --train-split"
            )
    except (data.DataError, ValueError, OSError) as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
    loaded, encoder = backbones(settings)
    cfg = evaluation.EvalConfig(
        variants=args.variants,
        k=args.k,
        seed=args.seed,
        calibrations=args.calibration,
        head_methods=args.head_methods,
        poolings=args.pooling,
        max_prompt_labels=args.max_prompt_labels,
        progress=not args.no_progress,
        head_shots=args.head_shots,
        curve_repeats=args.curve_repeats,
        cache_dir=args.cache_dir,
        head_file=head_file,
        groups=groups,
        seen_in_fit=lambda fitted: data.seen_in_fit(fitted, test_src),
    )
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    report = evaluation.evaluate_all(loaded, settings, base, test, train, cfg, descriptions, log=log, encoder=encoder)
    report = {
        "model": settings.model,
        "encoder": settings.encoder,
        "device": str(loaded.model.device),
        "dtype": str(loaded.model.dtype).replace("torch.", ""),
        "input": test_src.description,
        "train": train_src.description if train_src else None,
        # test tickets whose text is also a --train ticket's (public sets share a few: BANKING77 6 of 3,080)
        "train_test_same_text": _same_text(test, train_src.rows) if train_src else None,
        "limit": args.limit,
        "train_per_label": args.train_per_label,
        "wall_s": round(time.perf_counter() - t_start, 1),
    } | report
    _print_table(report)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(report))
    if args.plot and report["methods"]:
        from worker.quality.plot import plot_confusions

        try:
            import matplotlib  # noqa: F401  -- an optional extra
        except ImportError:
            print("eval: --plot needs matplotlib (pip install 'triage[plot]'); results were written", file=sys.stderr)
            return 1

        plot_confusions(
            [(m["name"], report["labels"], m["confusion"]) for m in _plot_methods(report["methods"])], args.plot
        )
    return 0


def _same_text(test, train) -> int:
    """How many test tickets' texts (stripped) are also training tickets' texts."""
    seen = {r.text.strip() for r in train}
    return sum(r.text.strip() in seen for r in test)


def _base_task(settings, test, train, src):
    """The configured task when it covers the data's labels, else a task over the data's labels.

    Covers: every label of the test sample and the training file is one of the task's. A sample that lacks some
    of them (a small --limit, a file without one label) still gets the configured task whole -- its labels,
    descriptions and examples, the worker's prompt and shipped head -- and is scored over all of its labels.
    Only data with labels the built-in task lacks (CLINC150, BANKING77) gets a task over the data's labels
    (descriptions from the label map, or the built-in ones for the labels it shares; no examples); with
    TRIAGE_TASK_FILE / TRIAGE_LABELS set such data is an error.
    """
    from worker.assemble import task_from_settings
    from worker.engine.task import DEFAULT_LABELS, Task
    from worker.quality import data

    task = task_from_settings(settings)
    seen = set(data.label_order(test, train or []))
    descriptions = data.descriptions_from_label_map(src.label_map_path) if src.label_map_path else {}
    if settings.task_file is not None or settings.labels is not None:
        unknown = sorted(seen - set(task.labels))
        if unknown:
            raise ValueError(f"the data has labels the task does not know: {unknown}")
        return task, descriptions
    if seen <= set(task.labels):
        return task, descriptions
    labels = data.label_order(test, train or [], preferred=list(DEFAULT_LABELS))
    known = {lab: DEFAULT_LABELS[lab] for lab in labels if lab in DEFAULT_LABELS}
    return Task(tuple(labels), {}, (), task.instructions), descriptions | known


def _plot_methods(methods: list[dict]) -> list[dict]:
    """At most 9 panels: uncalibrated prompts and mean-pooled heads first."""
    first = [m for m in methods if m.get("calibration") == "none" and "/last" not in m["name"]]
    rest = [m for m in methods if m not in first]
    return (first + rest)[:9]


def _print_table(report: dict) -> None:
    out = sys.stdout
    print(
        f"model {report['model']} ({report['dtype']}, {report['device']})  test {report['n_test']}: {report['input']}",
        file=out,
    )
    if report["train"]:
        print(f"train {report['n_train']}: {report['train']}", file=out)
        if report.get("train_test_same_text"):
            print(f"  note: {report['train_test_same_text']} test tickets have the text of a --train ticket", file=out)
    if report.get("fine_labels"):
        fine = report["fine_labels"]
        print(f"heads fitted on {fine['fine']} fine labels summed into {fine['summed_into']} (--fine-labels)", file=out)
    for s in report["skipped"]:
        print(f"  skipped {s}", file=out)
    print(f"{'method':40s} {'acc':>6s} {'macroF1':>7s} {'ECE':>6s}  coverage/acc at p>=0.5, 0.7", file=out)
    for m in report["methods"]:
        sel = {s["threshold"]: s for s in m["selective"]}
        cov = "  ".join(
            f"{sel[t]['coverage']:.2f}/" + (f"{sel[t]['accuracy']:.2f}" if sel[t]["accuracy"] is not None else "-")
            for t in (0.5, 0.7)
        )
        print(f"{m['name']:40s} {m['accuracy']:6.3f} {m['macro_f1']:7.3f} {m['ece']:6.3f}  {cov}", file=out)
    per = _per(report)
    for c in report["learning_curve"]:
        print(
            f"  curve: {c['per_label']:3d}/{per} head {c['method']}/{c['pooling']}: acc {c['accuracy']:.3f} "
            f"[{c['accuracy_min']:.3f}-{c['accuracy_max']:.3f}] macroF1 {c['macro_f1']:.3f} "
            f"ECE {c['ece']:.3f} ({c['repeats']}x)",
            file=out,
        )
    default = report["worker_default"] or f"not measured (the worker runs {report.get('worker_runs')})"
    print(f"best: {report['best']}   worker default: {default}   ({report['wall_s']} s)", file=out)


def _per(report: dict) -> str:
    """What a learning-curve count counts: tickets per label, or per fine label (--fine-labels)."""
    return "fine label" if report.get("fine_labels") else "label"


def markdown_table(report: dict) -> str:
    """The methods table (and learning curve) as Markdown, for docs."""
    lines = [
        f"{report['model']} ({report['dtype']}, {report['device']}); "
        f"test: {report['n_test']} tickets, train: {report['n_train']}"
        + (
            f"; heads fitted on {report['fine_labels']['fine']} fine labels summed into "
            f"{report['fine_labels']['summed_into']}"
            if report.get("fine_labels")
            else ""
        ),
        "",
        "| method | accuracy | macro-F1 | ECE | kept at p>=0.5 (acc) | kept at p>=0.7 (acc) |",
        "|---|---|---|---|---|---|",
    ]
    for m in report["methods"]:
        sel = {s["threshold"]: s for s in m["selective"]}
        cells = [
            f"{sel[t]['coverage']:.0%} ({sel[t]['accuracy']:.2f})" if sel[t]["accuracy"] is not None else "0%"
            for t in (0.5, 0.7)
        ]
        name = m["name"] + (" **(worker default)**" if m["name"] == report.get("worker_default") else "")
        lines.append(
            f"| {name} | {m['accuracy']:.3f} | {m['macro_f1']:.3f} | {m['ece']:.3f} | {cells[0]} | {cells[1]} |"
        )
    if report["learning_curve"]:
        shots = sorted({c["per_label"] for c in report["learning_curve"]})
        lines += [
            "",
            "| head | " + " | ".join(f"{n}/{_per(report)}" for n in shots) + " |",
            "|---|" + "---|" * len(shots),
        ]
        for key in dict.fromkeys((c["method"], c["pooling"]) for c in report["learning_curve"]):
            row = {c["per_label"]: c for c in report["learning_curve"] if (c["method"], c["pooling"]) == key}
            lines.append(f"| {key[0]}/{key[1]} | " + " | ".join(f"{row[n]['accuracy']:.2f}" for n in shots) + " |")
    return "\n".join(lines) + "\n"
