"""Compare scoring methods on one labelled set, sharing forward passes wherever possible.

Per prompt variant (zero-shot, label descriptions, few-shot, the task as configured) one bucketed pass over the
test tickets gives the label scores, and calibration variants (contextual, prior) only change the bias subtracted
afterwards. The head is fitted on one pass over the training tickets and scored on the pooled states the configured
task's test pass already produced. So N variants cost N test passes + 1 train pass, not one per method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from worker.assemble import build_classifier, features_classifier, prompt_scoring, task_example_features
from worker.engine.classifier import Classifier, softmax
from worker.engine.loader import LoadedModel
from worker.engine.task import Task
from worker.quality import calibration as cal
from worker.quality import metrics
from worker.quality.data import Labelled
from worker.quality.features import Features, run_features
from worker.quality.fewshot import for_prompt, pick_examples
from worker.quality.head import fit_head_for, prompt_hash
from worker.quality.worker_default import describe_method, is_method, worker_default
from worker.scorer_plan import shipped_head_for

VARIANTS = ("zero-shot", "descriptions", "few-shot", "task", "head")
THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


@dataclass
class EvalConfig:
    variants: Sequence[str] = VARIANTS
    k: int = 2
    seed: int = 0
    calibrations: Sequence[str] = ("none", "contextual", "prior")
    head_methods: Sequence[str] = ("logreg", "centroid")
    poolings: Sequence[str] = ("mean", "last")
    max_prompt_labels: int = 30
    head_shots: Sequence[int] = ()  # learning curve: examples per label to fit the head on
    curve_repeats: int = 3
    cache_dir: Path | None = None  # forward-pass results cache (see features.run_features)
    head_file: Path | None = None  # a head fitted by `triage-worker fit`, scored too (if it fits the task's prompt)
    blocks: Sequence[int] | None = None  # joined features: widths normalized apart (from the head pass's classifier)
    # fine label -> coarse label (``data.Source.groups()``): the training rows carry fine labels, the heads fitted on
    # them learn those and answer in the coarse ones, each the sum of its fine labels (``fit --fine-labels``)
    groups: dict[str, str] | None = None
    # a head file's recorded training rows (``meta["data"]``) -> whether the test rows may be among them
    # (eval: ``data.seen_in_fit``): such a head is marked "(seen in fit)" and never named best
    seen_in_fit: Callable[[Sequence[dict]], bool] | None = None
    progress: bool = True
    skipped: list[str] = field(default_factory=list)  # filled in: what was not run, and why


def variant_tasks(
    base: Task, descriptions: dict[str, str], train: Sequence[Labelled] | None, cfg: EvalConfig
) -> tuple[dict[str, Task], str]:
    """The prompt variants to run, de-duplicated by content, and the name of the one equal to ``base``
    (the configured task: the head is fitted on its pooled states)."""
    labels, instr = base.labels, base.instructions
    desc = {lab: d for lab, d in (descriptions | base.descriptions).items() if lab in labels}
    out: dict[str, Task] = {}
    if "zero-shot" in cfg.variants:
        out["zero-shot"] = base.labels_only()
    if "descriptions" in cfg.variants:
        if desc:
            out["descriptions"] = Task(labels, desc, (), instr)
        else:
            cfg.skipped.append("descriptions: no label descriptions (give --task or --label-map)")
    if "few-shot" in cfg.variants:
        if train:
            out["few-shot"] = Task(labels, desc, tuple(pick_examples(train, cfg.k, cfg.seed, labels)), instr)
        elif base.examples:
            out["few-shot"] = Task(labels, desc, base.examples, instr)
        else:
            cfg.skipped.append("few-shot: no training file and no examples in the task")
    base_name = next((n for n, t in out.items() if t == base), "task")
    if base_name == "task":
        out["task"] = base
    elif "task" in cfg.variants:
        cfg.skipped.append(f"task: the configured task is the same prompt as '{base_name}'")
    return out, base_name


def make_classifier(loaded: LoadedModel, task: Task, settings) -> Classifier:
    """The worker's classifier for ``task`` on an already-loaded model, with prompt scoring, no calibration,
    no threshold, truncation on: eval derives every method from the raw scores and pooled states."""
    return build_classifier(prompt_scoring(settings), loaded=loaded, task=task)


def score_method(name: str, probs: np.ndarray, labels: Sequence[str], gold: Sequence[str], extra: dict) -> dict:
    pred = [labels[k] for k in probs.argmax(1)]
    conf = probs.max(1)
    rep = metrics.evaluate(gold, pred, labels, conf)
    correct = [p == g for p, g in zip(pred, gold)]
    return {"name": name, **extra, **rep.to_dict(), "selective": metrics.selective_accuracy(conf, correct, THRESHOLDS)}


def evaluate_all(
    loaded: LoadedModel,
    settings,
    base: Task,
    test: Sequence[Labelled],
    train: Sequence[Labelled] | None,
    cfg: EvalConfig,
    descriptions: dict[str, str] | None = None,
    log=print,
    encoder: LoadedModel | None = None,
) -> dict:
    """Score every requested method on ``test``; the report is plain JSON-able data.

    Heads are fitted on the pooled states the worker's head reads (``features_classifier``: the
    ``TRIAGE_HEAD_PROMPT`` prompt; an encoder's or joined states). An encoder or joined features
    have no label tokens: only heads are measured for them. With ``cfg.groups`` the ``train`` rows carry
    fine labels: the heads fitted on them learn those; everything else sees the coarse ones."""
    labels = list(base.labels)
    head_train = train
    if cfg.groups and train:
        train = [Labelled(r.text, cfg.groups[r.label]) for r in train]
    gold = [r.label for r in test]
    texts = [r.text for r in test]
    head_only = loaded.kind != "decoder" or encoder is not None
    shots = for_prompt(train, loaded)  # few-shot picks: no ticket whose text the prompt would read as control tokens
    tasks, base_name = variant_tasks(base, descriptions or {}, shots, cfg) if not head_only else ({}, "task")
    if head_only:
        joined = f" + {encoder.name}" if encoder else ""
        cfg.skipped.append(
            f"prompt scoring: {loaded.name}{joined} has no label tokens (encoder / joined features): heads only"
        )
    too_many = len(labels) > cfg.max_prompt_labels
    if too_many:
        cfg.skipped.append(
            f"prompt scoring: {len(labels)} labels > --max-prompt-labels {cfg.max_prompt_labels} (head only)"
        )
    want_head = "head" in cfg.variants
    if want_head and not train and not base.examples and cfg.head_file is None:
        cfg.skipped.append("head: needs a training file (--train), examples in the task, or a head file")
        want_head = False
    results, passes, info = [], {}, {"head_prompt": settings.head_prompt if not head_only or encoder else None}
    for name, task in tasks.items():
        score = not too_many and name in cfg.variants
        if not score:
            continue
        clf = make_classifier(loaded, task, settings)
        items = clf.prepare_valid(texts)
        p = run_features(
            clf, items, score=score, desc=f"test pass: {name}", progress=cfg.progress, cache_dir=cfg.cache_dir
        )
        passes[name] = (clf, p)
        info[name] = {
            "prefix_tokens": clf.prefix_length,
            "examples": len(task.examples),
            "scored": score,
            "seconds": round(p.seconds, 1),
            "tickets_per_s": round(len(items) / p.seconds, 1) if p.seconds else None,
            "from_cache": p.cached,
            "prompt_hash": prompt_hash(clf),
        }
        log(
            f"{name}: {len(items)} tickets in {p.seconds:.1f} s{' (cached)' if p.cached else ''} "
            f"(prefix {clf.prefix_length} tokens)"
        )
        if not score:
            continue
        for c in cfg.calibrations:
            bias = _bias(c, clf, p)
            extra = {"method": "prompt", "variant": name, "calibration": c, "seconds": info[name]["seconds"]}
            results.append(
                score_method(name if c == "none" else f"{name} +{c}", softmax(p.log_scores - bias), labels, gold, extra)
            )
    curve: list[dict] = []
    if want_head:
        heads, curve = _heads(
            base,
            _head_pass(loaded, encoder, settings, base, texts, passes, cfg, info, log),
            head_train,
            labels,
            gold,
            cfg,
            info,
            log,
        )
        results += heads
    fair = [r for r in results if not r.get("seen_in_fit")]  # a head scored on its own training rows: not best
    best = max(fair, key=lambda r: (r["accuracy"], r["macro_f1"]), default=None)
    default = worker_default(
        settings, base, settings.head_path, needs_head=head_only, fits=_fits_worker(loaded, encoder, settings, base)
    )
    if default.get("variant") == "task":  # prompt variants are named by content: "task" may have been de-duplicated
        default["variant"] = base_name
    fine = sorted({r.label for r in head_train}) if want_head and cfg.groups and head_train else None
    return {
        "worker_default": next((m["name"] for m in results if is_method(m, default)), None),
        "worker_runs": describe_method(default),
        "labels": labels,
        "n_test": len(test),
        "n_train": len(train or []),
        "fine_labels": {"fine": len(fine), "summed_into": len(labels)} if fine else None,
        "seed": cfg.seed,
        "k": cfg.k,
        "passes": info,
        "skipped": cfg.skipped,
        "best": best["name"] if best else None,
        "methods": results,
        "learning_curve": curve,
    }


def _fits_worker(loaded, encoder, settings, base: Task) -> Callable[[Path], bool]:
    """Whether a head file fits the states the worker's head reads (``TRIAGE_HEAD_PROMPT``): the check the
    builder makes before it runs the shipped head (``assemble.load_shipped_head``)."""
    from worker.quality.head import Head, HeadMismatch

    def fits(path: Path) -> bool:
        try:
            Head.load(path).check(features_classifier(settings, loaded=loaded, task=base, encoder=encoder))
        except HeadMismatch:
            return False
        return True

    return fits


def _head_pass(loaded, encoder, settings, base: Task, texts, passes: dict, cfg: EvalConfig, info: dict, log):
    """The test tickets' states under the head's prompt: a prompt variant's pass when it is the same prompt."""
    clf = features_classifier(settings, loaded=loaded, task=base, encoder=encoder)
    want = prompt_hash(clf)
    for name, (c, p) in passes.items():
        if prompt_hash(c) == want:
            info["head_pass"] = name
            return clf, p
    p = run_features(
        clf,
        clf.prepare_valid(texts),
        score=False,
        desc="test pass: head prompt",
        progress=cfg.progress,
        cache_dir=cfg.cache_dir,
    )
    info["head_pass"] = {
        "prefix_tokens": clf.prefix_length,
        "seconds": round(p.seconds, 1),
        "from_cache": p.cached,
        "prompt_hash": want,
    }
    log(
        f"head prompt ({clf.head_prompt or clf.kind}): {len(texts)} tickets in {p.seconds:.1f} s "
        f"(prefix {clf.prefix_length} tokens)"
    )
    return clf, p


def _bias(kind: str, clf: Classifier, p: Features) -> np.ndarray:
    if kind == "none":
        return np.zeros(p.log_scores.shape[1])
    if kind == "contextual":
        return cal.contextual_bias(clf)
    if kind == "prior":  # from the evaluated tickets' own predictions, labels unused (like a worker's recent traffic)
        return cal.bias_from_scores(p.log_scores)
    raise ValueError(f"unknown calibration {kind!r}")


def _heads(base, task_pass, train, labels, gold, cfg, info, log) -> tuple[list[dict], list[dict]]:
    clf, test_pass = task_pass
    cfg.blocks = clf.feature_blocks
    out = []
    if cfg.head_file is not None:
        out += _score_head_file(cfg.head_file, clf, test_pass, labels, gold, cfg)
    shipped = shipped_head_for(clf.model_name, base)
    if shipped is not None:
        out += _score_head_file(shipped, clf, test_pass, labels, gold, cfg, name="shipped default head")
    if base.examples and {e.label for e in base.examples} == set(labels):  # what `auto` fits at start-up
        ex, ex_labels = task_example_features(clf)  # clf's task is base: the examples as the worker reads them
        out += _fit_and_score("head on task examples", ex, ex_labels, test_pass, labels, gold, cfg)
    curve: list[dict] = []
    if train:
        tr = run_features(
            clf,
            clf.prepare_valid([r.text for r in train]),
            score=False,
            desc="train pass (head)",
            progress=cfg.progress,
            cache_dir=cfg.cache_dir,
        )
        info["train"] = {
            "tickets": len(train),
            "seconds": round(tr.seconds, 1),
            "from_cache": tr.cached,
            "tickets_per_s": round(len(train) / tr.seconds, 1) if tr.seconds else None,
        }
        log(f"train pass: {len(train)} tickets in {tr.seconds:.1f} s{' (cached)' if tr.cached else ''}")
        y = [r.label for r in train]  # fine labels with cfg.groups
        prefix = f"head on {len(set(y))} fine labels" if cfg.groups else "head"
        out += _fit_and_score(prefix, tr, y, test_pass, labels, gold, cfg, groups=cfg.groups)
        curve = learning_curve(tr, y, test_pass, labels, gold, cfg)
    return out, curve


def _score_head_file(
    path: Path, clf: Classifier, test_pass: Features, labels, gold, cfg: EvalConfig, name: str = "head file"
) -> list[dict]:
    from worker.quality.head import Head, HeadMismatch

    head = Head.load(path)
    try:
        head.check(clf)
    except HeadMismatch as e:
        cfg.skipped.append(f"head file {path}: {e}")
        return []
    head = head.reordered(labels)
    probs = head.probs(test_pass.pooled(head.pooling))
    extra = {
        "method": "head",
        "variant": f"{head.method}/{head.pooling}",
        "calibration": "none",
        "head_file": str(path),
    }
    seen = cfg.seen_in_fit is not None and cfg.seen_in_fit(head.meta.get("data") or [])
    if seen:
        extra["seen_in_fit"] = True
    name = f"{name} {head.method}/{head.pooling}" + (" (seen in fit)" if seen else "")
    return [score_method(name, probs, labels, gold, extra)]


def _fit(cfg: EvalConfig, x: np.ndarray, y: Sequence[str], labels, method: str, pooling: str, groups=None):
    """One head as eval fits them all: the run's seed and feature blocks; fine labels in ``y`` with ``groups``."""
    return fit_head_for(x, y, labels, groups=groups, method=method, pooling=pooling, seed=cfg.seed, blocks=cfg.blocks)


def _fit_and_score(
    prefix: str,
    tr: Features,
    y: Sequence[str],
    test_pass: Features,
    labels,
    gold,
    cfg: EvalConfig,
    groups: dict[str, str] | None = None,
) -> list[dict]:
    """Heads fitted on ``tr`` / ``y`` scored on the test pass; with ``groups`` ``y`` holds fine labels (see
    ``fit_head_for``) and the scores are over ``labels`` all the same."""
    out = []
    for pooling in cfg.poolings:
        for method in cfg.head_methods:
            t1 = time.perf_counter()
            head = _fit(cfg, tr.pooled(pooling), y, labels, method, pooling, groups)
            fit_s = time.perf_counter() - t1
            probs = head.probs(test_pass.pooled(pooling))
            extra = {
                "method": "head",
                "variant": f"{method}/{pooling}",
                "calibration": "none",
                "fit_seconds": round(fit_s, 2),
                "head": {k: v for k, v in head.meta.items() if k in ("l2", "temperature", "n_train")},
            }
            if groups:
                extra |= {"fine_labels": len(head.labels), "summed_into": len(labels)}
            out.append(score_method(f"{prefix} {method}/{pooling}", probs, labels, gold, extra))
    return out


def learning_curve(tr: Features, y: Sequence[str], test_pass: Features, labels, gold, cfg: EvalConfig) -> list[dict]:
    """Head quality when only n training tickets per label exist (seeded resamples of the train pass).
    With ``cfg.groups`` ``y`` holds fine labels and n counts tickets per fine label (as ``fit --per-label``)."""
    y_arr = np.array(y)
    by_label = {lab: np.flatnonzero(y_arr == lab) for lab in (sorted(set(y)) if cfg.groups else labels)}
    most = max(len(v) for v in by_label.values())
    rows = []
    for n in cfg.head_shots:
        repeats = 1 if n >= most else cfg.curve_repeats
        for pooling in cfg.poolings:
            for method in cfg.head_methods:
                acc, f1, ece = [], [], []
                for rep in range(repeats):
                    rng = np.random.default_rng(cfg.seed * 1000 + rep)
                    idx = np.concatenate([rng.permutation(v)[:n] for v in by_label.values() if len(v)])
                    head = _fit(cfg, tr.pooled(pooling)[idx], list(y_arr[idx]), labels, method, pooling, cfg.groups)
                    rep_ = metrics.evaluate_probs(gold, head.probs(test_pass.pooled(pooling)), labels)
                    acc.append(rep_.accuracy), f1.append(rep_.macro_f1), ece.append(rep_.ece)
                rows.append(
                    {
                        "per_label": n,
                        "method": method,
                        "pooling": pooling,
                        "repeats": repeats,
                        "accuracy": round(float(np.mean(acc)), 4),
                        "accuracy_min": round(min(acc), 4),
                        "accuracy_max": round(max(acc), 4),
                        "macro_f1": round(float(np.mean(f1)), 4),
                        "ece": round(float(np.mean(ece)), 4),
                    }
                )
    return rows
