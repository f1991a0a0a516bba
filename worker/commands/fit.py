"""Fit a scorer head on labelled tickets, and/or write few-shot examples into a task file.

  triage-worker fit --input TRAIN --out head.safetensors          # head for the configured task
  triage-worker fit --input TRAIN --examples-out task.yaml --k 2  # task file with k examples per label
  (both at once: the head is fitted for the new task file's prompt)
  triage-worker fit --default-head                                # refit the shipped default head (make default-head)

The head is tied to the model and the exact prompt (instructions, descriptions,
examples) it was fitted with; the worker refuses a head that does not match.
Start the worker with TRIAGE_HEAD_PATH=<out> (and TRIAGE_TASK_FILE=<examples-out>).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.commands.model_flags import add_model_arguments, settings_from_args

NAME = "fit"
HELP = "fit a scorer head (TRIAGE_HEAD_PATH) and/or pick few-shot examples into a task file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        default=None,
        help="labelled JSONL/CSV (text, label), or a named set like banking77 (its train split unless named)",
    )
    p.add_argument(
        "--default-head",
        action="store_true",
        help="refit the shipped default head for TRIAGE_MODEL (+ TRIAGE_ENCODER) by its fixed recipe "
        "(project's support tickets, fp32, one thread); --out defaults to the file inside the package",
    )
    p.add_argument(
        "--split", default=None, help="only rows whose 'split' field equals this (a named set: which of its files)"
    )
    p.add_argument("--label-map", type=Path, default=None, help="JSON {coarse: [fine, ...]} applied to the labels")
    p.add_argument(
        "--fine-labels",
        action="store_true",
        help="fit on the labels before the map (e.g. CLINC150's 150 intents) and answer in the mapped ones, each "
        "the sum of its fine labels' probabilities (needs --label-map or a named set with one: clinc150-domains)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the fitted head here (.safetensors)")
    p.add_argument("--method", choices=["logreg", "centroid"], default="logreg")
    p.add_argument("--pooling", choices=["mean", "last"], default="mean")
    p.add_argument("--per-label", type=int, default=None, help="fit on a seeded sample of at most N tickets per label")
    p.add_argument(
        "--examples-out",
        type=Path,
        default=None,
        help="write the configured task + k examples per label here (YAML/JSON)",
    )
    p.add_argument("--k", type=int, default=2, help="few-shot examples per label for --examples-out")
    p.add_argument("--seed", type=int, default=0)
    add_model_arguments(p)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from worker.assemble import task_from_settings
    from worker.quality import data
    from worker.quality.fewshot import pick_examples, write_task_file

    if args.default_head:
        return _default_head(args)
    if args.input is None:
        print("fit: --input is required (or --default-head)", file=sys.stderr)
        return 2
    if args.out is None and args.examples_out is None:
        print("fit: nothing to do: give --out (a head) and/or --examples-out (a task file)", file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    try:
        source = data.resolve(args.input, args.label_map, args.split, default_split="train")
        rows = source.rows
        if args.fine_labels and not source.label_map:
            raise ValueError("--fine-labels needs a label map (--label-map, or a named set like clinc150-domains)")
        for flag, path in (("--out", args.out), ("--examples-out", args.examples_out)):
            _writable(flag, path)  # before the model loads and the pass runs, not a traceback after them
        task = _task_for(task_from_settings(settings), rows, settings, args.examples_out is not None)
        if args.out:  # with --fine-labels: a task label no fine label maps to has no rows here either
            data.require_every_label(task.labels, rows, source.description)
    except (data.DataError, ValueError, OSError) as e:
        print(f"fit: {e}", file=sys.stderr)
        return 2
    if args.examples_out:
        from worker.engine.task_text import model_control_strings

        avoid = model_control_strings(settings.model, settings.cache_dir)  # no ticket the worker would refuse
        task = task.with_examples(pick_examples(rows, args.k, args.seed, task.labels, avoid=avoid))
        write_task_file(task, args.examples_out)
        print(
            f"wrote {len(task.examples)} examples ({args.k} per label) to {args.examples_out}  "
            f"-> TRIAGE_TASK_FILE={args.examples_out}"
        )
    if args.out:
        _fit(args, settings, task, source)
    return 0


def _task_for(task, rows, settings, writing_task: bool):
    """The configured task; when the data's labels differ from the built-in default, a task over them
    (only allowed when a task file is written, so the worker can run the very same prompt)."""
    from worker.engine.task import DEFAULT_LABELS, Task
    from worker.quality import data

    seen = data.label_order(rows, preferred=list(DEFAULT_LABELS))
    unknown = sorted(set(seen) - set(task.labels))
    if not unknown:
        return task
    if settings.task_file is None and settings.labels is None and writing_task:
        return Task(
            tuple(seen), {lab: DEFAULT_LABELS[lab] for lab in seen if lab in DEFAULT_LABELS}, (), task.instructions
        )
    raise ValueError(
        f"the data has labels the configured task does not know: {unknown[:10]}{' ...' if len(unknown) > 10 else ''} "
        "(set TRIAGE_LABELS / TRIAGE_TASK_FILE, or add --examples-out FILE to write a task file for these labels)"
    )


def _fit(args, settings, task, source) -> None:
    import time

    from worker.assemble import features_classifier
    from worker.quality import data
    from worker.quality.features import run_features
    from worker.quality.fewshot import pick_examples
    from worker.quality.head import fit_head_for, head_meta

    rows = source.fine_rows if args.fine_labels else source.rows
    if args.per_label:
        rows = [data.Labelled(e.text, e.label) for e in pick_examples(rows, args.per_label, args.seed, max_chars=None)]
    groups = source.groups() if args.fine_labels else None  # the head learns the fine labels, answers in the task's
    # the states a head reads in the worker (TRIAGE_HEAD_PROMPT, TRIAGE_ENCODER)
    clf = features_classifier(settings, task=task)
    t0 = time.perf_counter()
    items = clf.prepare_valid([r.text for r in rows])
    feats = run_features(clf, items, score=False, desc="fit pass", progress=not args.no_progress)
    secs = time.perf_counter() - t0
    meta = head_meta(clf, str(args.input)) | {"data": [data.provenance(source)]}  # eval: was a test set fitted on?
    head = fit_head_for(
        feats.pooled(args.pooling),
        [r.label for r in rows],
        task.labels,
        method=args.method,
        pooling=args.pooling,
        meta=meta,
        seed=args.seed,
        blocks=clf.feature_blocks,
        groups=groups,
    )
    head.save(args.out)
    fewest = min(head.meta["per_label"].values())
    if fewest < 8:
        print(
            f"note: only {fewest} tickets for some label; heads keep improving up to 30-100 per label (docs/quality.md)"
            + (
                "; with under 3 per label the centroid head is better calibrated"
                if args.method == "logreg" and fewest < 3
                else ""
            )
        )
    fine = f", {len(head.labels)} fine labels summed into {len(task.labels)}" if groups else ""
    print(f"fitted {args.method}/{args.pooling} head on {len(rows)} tickets{fine} ({secs:.0f} s forward) -> {args.out}")
    print(f"run the worker with: {_serve_env(args, settings)} (TRIAGE_SCORER=auto or head)")


def _writable(flag: str, path: Path | None) -> None:
    """A ``ValueError`` (exit 2) for an output path that cannot be written: a directory, an unwritable folder."""
    import os

    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its folder: {e.strerror or e}") from None
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: its folder {path.parent} is not writable")


def _serve_env(args: argparse.Namespace, settings) -> str:
    """The settings the worker needs to serve this head: every one the head is tied to that is not the default
    (the hint named the head alone, and a head fitted on bundled:minilm then failed against the default model)."""
    import shlex

    from worker.settings import Settings

    env = {"TRIAGE_HEAD_PATH": args.out, "TRIAGE_TASK_FILE": args.examples_out or settings.task_file}
    for name in ("model", "encoder", "labels", "head_prompt"):
        if getattr(settings, name) != Settings.model_fields[name].default:
            env[f"TRIAGE_{name.upper()}"] = getattr(settings, name)
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items() if v is not None)


def _default_head(args: argparse.Namespace) -> int:
    """The shipped head's fixed recipe (worker/quality/default_head.py) for the configured model (+ encoder)."""
    import torch

    from worker.assemble import features_classifier
    from worker.engine.task import default_task
    from worker.heads import HEADS_DIR, SHIPPED
    from worker.quality.default_head import DTYPE, model_file_hash, refit

    args.dtype, args.device = args.dtype or DTYPE, args.device or "cpu"
    settings = settings_from_args(args)
    torch.set_num_threads(1)  # summation order fixed: the same machine refits the same bytes
    clf = features_classifier(settings, task=default_task())
    out = args.out
    if out is None:
        if clf.model_name not in SHIPPED:
            known = sorted(SHIPPED)
            print(f"fit: no shipped head file for {clf.model_name!r} (known: {known}); give --out", file=sys.stderr)
            return 2
        out = HEADS_DIR / SHIPPED[clf.model_name]
    parts = ["triage-worker fit --default-head", f"--model {settings.model}"]
    parts += ([f"--encoder {settings.encoder}"] if settings.encoder else []) + [f"--head-prompt {settings.head_prompt}"]
    parts += [f"--dtype {clf.dtype_name}"]
    models = [clf.loaded] + ([clf.encoder] if clf.encoder is not None else [])
    hashes = [model_file_hash(m.name, m.source) for m in models]
    head = refit(clf, " ".join(parts), model_sha256="+".join(h or "-" for h in hashes))
    head.save(out)
    print(f"wrote {out} ({clf.model_name}, {settings.head_prompt} prompt, {clf.dtype_name})")
    return 0
