"""The side-by-side quality table: every backbone and head against a TF-IDF floor, on the same rows.

``scripts/quality_table.py`` runs it. Pooled states come from ``FeatureStore`` (computed
once, then read from disk), so the whole table re-runs in seconds after the first time.
Rows: TF-IDF + logistic regression (scikit-learn, the optional ``quality`` extra; the
worker never imports it), the old start-up default (centroid on the task's 5 examples),
a logistic head on the LM's states (head prompt ``labels`` and ``task``), on
all-MiniLM-L6-v2's embedding, on both joined, and the shipped default head.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from worker.engine.results import decide
from worker.quality import data, metrics, suites
from worker.quality.features import FeatureStore
from worker.quality.head import Head, fit_head, fit_head_for

DEFAULT_CACHE = Path("out") / "quality-cache" / "features"
LM, ENCODER = "bundled:smollm2", "bundled:minilm"
_LOADED: dict = {}


def _loaded(settings, name: str):
    """One load per (model, dtype, device) for the whole table (through the worker's one loader)."""
    from worker.assemble import load

    key = (name, settings.dtype, settings.device)
    if key not in _LOADED:
        _LOADED[key] = load(settings, name)
    return _LOADED[key]


def feature_store(settings, task, root: Path = DEFAULT_CACHE) -> FeatureStore:
    """Pooled states of ``settings.model`` under ``task``'s prompt (an encoder ignores the prompt)."""
    from worker.assemble import engine_options, prompt_scoring
    from worker.engine.classifier import Classifier

    loaded = _loaded(settings, settings.model)
    return FeatureStore(root, Classifier(loaded, task, engine_options(prompt_scoring(settings), loaded.model.device)))


@dataclass
class Cell:
    accuracy: float
    ece: float
    macro_f1: float
    n: int
    note: str = ""

    def md(self) -> str:
        return f"{self.accuracy:.3f} (ECE {self.ece:.3f}){self.note}"


@dataclass
class Table:
    columns: list[str]
    rows: dict[str, dict[str, Cell]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, row: str, column: str, cell: Cell | None) -> None:
        if cell is not None:
            self.rows.setdefault(row, {})[column] = cell

    def markdown(self) -> str:
        head = "| method | " + " | ".join(self.columns) + " |"
        lines = [head, "|---|" + "---|" * len(self.columns)]
        shipped = [n for n in self.rows if n.startswith("shipped")]
        for name in [n for n in self.rows if n not in shipped] + shipped:  # the shipped heads last
            cells = self.rows[name]
            lines.append(f"| {name} | " + " | ".join(cells[c].md() if c in cells else "–" for c in self.columns) + " |")
        return "\n".join(lines) + "\n" + "".join(f"\n{n}" for n in self.notes) + ("\n" if self.notes else "")

    def to_dict(self) -> dict:
        return {
            "columns": self.columns,
            "notes": self.notes,
            "rows": {r: {c: vars(cell) for c, cell in cells.items()} for r, cells in self.rows.items()},
        }


def score(probs: np.ndarray, labels: Sequence[str], gold: Sequence[str], note: str = "") -> Cell:
    rep = metrics.evaluate_probs(gold, probs, labels)
    return Cell(round(rep.accuracy, 4), round(rep.ece, 4), round(rep.macro_f1, 4), len(gold), note)


def head_cell(
    train_x: np.ndarray,
    train_y: Sequence[str],
    test_x: np.ndarray,
    labels,
    gold,
    *,
    blocks=None,
    method: str = "logreg",
    seed: int = 0,
) -> Cell:
    head = fit_head(train_x, train_y, labels, method=method, seed=seed, blocks=blocks)
    return score(head.probs(test_x), labels, gold)


def tfidf_cell(train, test, labels) -> Cell:
    """Word 1-2-gram + character 2-5-gram TF-IDF + logistic regression, C by 3-fold CV: the floor a practitioner
    starts from."""
    return score(tfidf_probs(train, labels)(_texts(test)), labels, [r.label for r in test])


def tfidf_probs(train, labels, groups: dict[str, str] | None = None) -> Callable[[Sequence[str]], np.ndarray]:
    """The floor fitted on ``train``: texts -> probabilities over ``labels``; with ``groups`` (fine -> label) it is
    fitted on the fine labels of ``train`` and each label's probability is the sum of its fine labels'."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_union

    vec = make_union(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, lowercase=True),
        TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, lowercase=True),
    )
    x = vec.fit_transform([r.text for r in train])
    clf = LogisticRegressionCV(Cs=[0.3, 1, 3, 10, 30, 100], cv=3, max_iter=3000, random_state=0)
    clf.fit(x, [r.label for r in train])
    m = np.zeros((len(clf.classes_), len(labels)))
    for i, c in enumerate(clf.classes_):
        m[i, list(labels).index(groups[c] if groups else c)] = 1.0
    return lambda texts: clf.predict_proba(vec.transform(list(texts))) @ m


def _texts(rows) -> list[str]:
    return [r.text for r in rows]


def build_table(
    settings,
    suite_names: Sequence[str],
    *,
    head_prompt: str,
    log: Callable[[str], None] = print,
    root: Path = DEFAULT_CACHE,
    with_tfidf: bool = True,
) -> Table:
    """The main table: one column per reporting set, every method fitted on the suite's train rows."""
    from worker.heads import shipped_head_path

    columns = []
    loaded_suites = {n: suites.load(n) for n in suite_names}
    for s in loaded_suites.values():
        columns += list(s.tests)
    table = Table(columns)
    lm_settings = settings.model_copy(update={"model": LM})
    enc_settings = settings.model_copy(update={"model": ENCODER})
    for name, suite in loaded_suites.items():
        t0 = time.perf_counter()
        labels, y = list(suite.labels), [r.label for r in suite.train]
        lm = feature_store(lm_settings, suite.prompt_task(head_prompt), root)
        enc = feature_store(enc_settings, suite.task, root)
        lm_tr = lm.get(_texts(suite.train), desc=f"{name} train (LM)").mean
        enc_tr = enc.get(_texts(suite.train), desc=f"{name} train (MiniLM)").mean
        for col, rows in suite.tests.items():
            gold = [r.label for r in rows]
            lm_te = lm.get(_texts(rows), desc=f"{col} (LM)").mean
            enc_te = enc.get(_texts(rows), desc=f"{col} (MiniLM)").mean
            if with_tfidf:
                table.add("TF-IDF + logistic regression (floor)", col, tfidf_cell(suite.train, rows, labels))
            if name == "support":  # what the worker did before: a centroid on the task's own 5 examples
                full = feature_store(lm_settings, suite.task, root)
                ex = full.get([e.text for e in suite.task.examples], desc="task examples").mean
                cell = head_cell(
                    ex,
                    [e.label for e in suite.task.examples],
                    full.get(_texts(rows)).mean,
                    labels,
                    gold,
                    method="centroid",
                )
                table.add("old default: centroid head on the task's 5 examples (SmolLM2, task prompt)", col, cell)
            table.add(f"SmolLM2-135M head ({head_prompt} prompt)", col, head_cell(lm_tr, y, lm_te, labels, gold))
            table.add("all-MiniLM-L6-v2 head", col, head_cell(enc_tr, y, enc_te, labels, gold))
            if suite.more_train:  # the cheapest lever: more labelled rows (an encoder pass costs ~1/10 of the LM's)
                more = enc.get(_texts(suite.more_train), desc=f"{name} more train (MiniLM)").mean
                cell = head_cell(more, [r.label for r in suite.more_train], enc_te, labels, gold)
                table.add(f"all-MiniLM-L6-v2 head, 3x the training rows ({len(suite.more_train):,})", col, cell)
            joined_tr, joined_te = np.concatenate([lm_tr, enc_tr], 1), np.concatenate([lm_te, enc_te], 1)
            blocks = (lm_tr.shape[1], enc_tr.shape[1])
            table.add(
                f"SmolLM2 ({head_prompt} prompt) + MiniLM joined head",
                col,
                head_cell(joined_tr, y, joined_te, labels, gold, blocks=blocks),
            )
            if name == "support":
                for model, feats in ((LM, None), (ENCODER, enc_te), (f"{LM}+{ENCODER}", None)):
                    path = shipped_head_path(model)
                    if path is None:
                        continue
                    head = Head.load(path)
                    if feats is None:
                        lmf = feature_store(lm_settings, suite.prompt_task(head.meta.get("head_prompt", "task")), root)
                        x = lmf.get(_texts(rows)).mean
                        feats = x if model == LM else np.concatenate([x, enc_te], 1)
                    seen = _seen_by(head, col)
                    cell = score(head.reordered(labels).probs(feats), labels, gold, " (seen in fit)" if seen else "")
                    table.add(f"shipped default head: {path.name}", col, cell)
        log(
            f"{name}: done in {time.perf_counter() - t0:.0f} s "
            f"(LM computed {lm.computed}, MiniLM computed {enc.computed})"
        )
    return table


def _seen_by(head: Head, column: str) -> bool:
    """Whether the shipped head's training data included this reporting set (support-60: yes, written-104: never)."""
    return column in head.meta.get("fitted_on_reporting_sets", [])


def head_prompt_table(settings, root: Path = DEFAULT_CACHE, log: Callable[[str], None] = print) -> Table:
    """Labels-only vs full task prompt, same rows for both (CLINC/BANKING77 on training subsets: the full
    task prompt's long prefix makes the LM pass the slowest part of the table)."""
    from worker.quality.data import Labelled, subsample
    from worker.quality.fewshot import pick_examples

    lm_settings = settings.model_copy(update={"model": LM})
    plans = [("support", 0, {}), ("clinc150-domains", 30, {}), ("banking77", 5, {"banking77-500": 200})]
    table = Table([])
    for name, per_label, test_n in plans:
        suite = suites.load(name)
        train = (
            suite.train
            if not per_label
            else [Labelled(e.text, e.label) for e in pick_examples(suite.train, per_label, 0, max_chars=None)]
        )
        y, labels = [r.label for r in train], list(suite.labels)
        for col, rows in suite.tests.items():
            rows = subsample(rows, test_n[col], 0) if col in test_n else rows
            column = f"{col} (train {len(train)}, test {len(rows)})"
            table.columns.append(column)
            for hp in suites.HEAD_PROMPTS:
                store = feature_store(lm_settings, suite.prompt_task(hp), root)
                prefix = store.clf.prefix_length
                cell = head_cell(
                    store.get(_texts(train)).mean, y, store.get(_texts(rows)).mean, labels, [r.label for r in rows]
                )
                cell.note = f" [{prefix}-token prefix]"
                table.add(f"SmolLM2 head, {hp} prompt", column, cell)
        log(f"head prompt: {name} done")
    return table


def every_row_table(
    settings, root: Path = DEFAULT_CACHE, log: Callable[[str], None] = print, with_tfidf: bool = True
) -> Table:
    """The largest lever, measured: heads fitted on every training row CLINC150 (15,100) and BANKING77 (10,003)
    ship, on the same test rows as the main table. all-MiniLM-L6-v2 only (its pass costs ~1/10 of the LM's).

    CLINC150 also as fine labels (150 intents + ``oos``, summed per domain: ``fit --fine-labels``) and with the
    ``oos`` fallback below a confidence threshold picked on the validation split (``TRIAGE_CONFIDENCE_THRESHOLD``).
    """
    enc_settings = settings.model_copy(update={"model": ENCODER})
    clinc, bank = suites.load("clinc150-domains"), suites.load("banking77")
    table = Table(list(clinc.tests) + list(bank.tests))
    every = "every training row"
    for suite, spec in ((clinc, "clinc150-domains"), (bank, "banking77")):
        t0 = time.perf_counter()
        src = data.resolve(f"{spec}:train")
        labels, y = list(suite.labels), [r.label for r in src.rows]
        enc = feature_store(enc_settings, suite.task, root)
        x_tr = enc.get(_texts(src.rows), desc=f"{spec} all train (MiniLM)").mean
        ((col, rows),) = suite.tests.items()
        gold, x_te = [r.label for r in rows], enc.get(_texts(rows), desc=f"{col} (MiniLM)").mean
        n = f"{len(src.rows):,}"
        if with_tfidf:
            table.add(f"TF-IDF + logistic regression, {every} ({n})", col, tfidf_cell(src.rows, rows, labels))
        table.add(f"all-MiniLM-L6-v2 head, {every} ({n})", col, head_cell(x_tr, y, x_te, labels, gold))
        if src.label_map:  # CLINC150: the intents the domains are made of
            head = fit_head_for(x_tr, [r.label for r in src.fine_rows], labels, groups=src.groups())
            name = f"all-MiniLM-L6-v2 head, {every} ({n}), {len(head.labels)} fine labels summed per label"
            table.add(name, col, score(head.probs(x_te), labels, gold))
            val = data.resolve(f"{spec}:val").rows
            x_val = enc.get(_texts(val), desc=f"{spec} validation (MiniLM)").mean
            cell = _oos_threshold_cell(head.probs(x_val), [r.label for r in val], head.probs(x_te), labels, gold)
            table.add(f"{name}, `oos` below a confidence threshold", col, cell)
            if with_tfidf:  # the floor under the same protocol
                floor = tfidf_probs(src.fine_rows, labels, src.groups())
                cell = _oos_threshold_cell(
                    floor(_texts(val)), [r.label for r in val], floor(_texts(rows)), labels, gold
                )
                table.add(f"TF-IDF + logistic regression, {every}, fine labels, `oos` below a threshold", col, cell)
        log(f"every row: {spec} done in {time.perf_counter() - t0:.0f} s (MiniLM computed {enc.computed})")
    return table


def _oos_threshold_cell(dev_probs, dev_gold, probs, labels, gold) -> Cell:
    """``oos`` as the fallback below the confidence threshold that is best on the development rows."""
    t, _ = metrics.pick_threshold(dev_probs, labels, dev_gold, "oos")
    rep = metrics.evaluate(gold, decide(probs, labels, t, "oos"), labels)
    ece = metrics.evaluate_probs(gold, probs, labels).ece  # a row sent to oos has no probability of its own
    note = f" [oos below {t:.2f}, picked on {len(dev_gold):,} validation rows; ECE of the probabilities]"
    return Cell(round(rep.accuracy, 4), round(ece, 4), round(rep.macro_f1, 4), len(gold), note)
