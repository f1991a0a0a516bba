"""The shipped default head: fitted by a fixed recipe, reproducible bit for bit, with its figures inside.

``triage-worker fit --default-head`` (``make default-head``) runs the recipe:

1. pooled states of every labelled support ticket of the project (``tests/data``), fp32, one thread;
2. **protocol**: a head fitted on the train splits only (first set 50 + written 212), scored on the
   first set's 60 test tickets and on the 104 written test tickets;
3. **shipped**: a head fitted on everything except the written test split (first set 110 + written
   212 = 322 tickets), scored on the 104 written test tickets, which no head ever saw;
4. saved as safetensors with the provenance (data files and their sha256, model and its file hash,
   prompt hash, head prompt, seed, dtype, command) and both sets of figures in the metadata.

Nothing in the file depends on the time or the machine's paths, so a refit on the same machine
(same torch, one thread) writes the same bytes (``tests/integration/test_default_head.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from worker.quality import metrics
from worker.quality.data import Labelled, load_labelled, sha256_file
from worker.quality.suites import FIRST, ROOT, WRITTEN

SPLITS = [(f, s) for f in (FIRST, WRITTEN) for s in ("train", "test")]  # (file, split), in feature-pass order
REPORTING = {"support-60": (FIRST, "test"), "support-written-104": (WRITTEN, "test")}
PROTOCOL_TRAIN = [(FIRST, "train"), (WRITTEN, "train")]
SHIPPED_TRAIN = [(FIRST, "train"), (FIRST, "test"), (WRITTEN, "train")]  # never WRITTEN test
METHOD, POOLING, SEED, DTYPE = "logreg", "mean", 0, "fp32"


def model_file_hash(name: str, source: str) -> str | None:
    """sha256 of the weights file a model name resolves to (bundled GGUF / zip, or a directory's safetensors)."""
    from worker.engine.constants import BUNDLED_MINILM, BUNDLED_MODEL
    from worker.engine.loader import bundled_gguf_path, bundled_minilm_zip

    if name == BUNDLED_MODEL:
        return sha256_file(bundled_gguf_path())
    if name == BUNDLED_MINILM:
        return sha256_file(bundled_minilm_zip())
    weights = Path(source) / "model.safetensors"
    return sha256_file(weights) if weights.is_file() else None


def _figures(head, x: np.ndarray, rows: list[Labelled]) -> dict:

    rep = metrics.evaluate_probs([r.label for r in rows], head.probs(x), list(head.labels))
    return {
        "n": len(rows),
        "accuracy": round(rep.accuracy, 4),
        "macro_f1": round(rep.macro_f1, 4),
        "ece": round(rep.ece, 4),
    }


def refit(clf, command: str, root: Path = ROOT, log: Callable[[str], None] = print, model_sha256: str | None = None):
    """Run the recipe on ``clf`` (its model, prompt and dtype); returns the shipped ``Head``."""
    from worker.quality.features import run_features
    from worker.quality.head import fit_head, prompt_hash

    labels = list(clf.labels)
    every = {part: load_labelled(root / part[0], split=part[1]) for part in SPLITS}
    texts = [r.text for rows in every.values() for r in rows]
    feats = run_features(
        clf, clf.prepare_valid(texts), score=False, desc="default head: features", progress=False
    ).pooled(POOLING)
    x, start = {}, 0
    for part, rows in every.items():
        x[part] = feats[start : start + len(rows)]
        start += len(rows)

    def fit(parts):
        rows = [r for p in parts for r in every[p]]
        xs = np.concatenate([x[p] for p in parts])
        return fit_head(
            xs, [r.label for r in rows], labels, method=METHOD, pooling=POOLING, seed=SEED, blocks=clf.feature_blocks
        ), len(rows)

    def scored(head, names) -> dict:
        return {name: _figures(head, x[REPORTING[name]], every[REPORTING[name]]) for name in names}

    unseen = [name for name, part in REPORTING.items() if part not in SHIPPED_TRAIN]
    protocol, n_protocol = fit(PROTOCOL_TRAIN)
    figures = {"protocol": {"fitted_on": n_protocol, **scored(protocol, REPORTING)}}
    log(f"protocol head (fitted on {n_protocol} train-split tickets): {figures['protocol']}")
    shipped, n_shipped = fit(SHIPPED_TRAIN)
    figures["shipped"] = {"fitted_on": n_shipped, **scored(shipped, unseen)}
    log(f"shipped head (fitted on {n_shipped} tickets, never on the written test split): {figures['shipped']}")
    data = [
        {"file": f, "sha256": sha256_file(root / f), "fitted_splits": [s for g, s in SHIPPED_TRAIN if g == f]}
        for f in (FIRST, WRITTEN)
    ]
    import torch

    shipped.meta.update(
        model=clf.model_name,
        model_sha256=model_sha256,
        prompt_hash=prompt_hash(clf),
        head_prompt=clf.head_prompt,
        dtype=clf.dtype_name,
        seed=SEED,
        torch=torch.__version__.split("+")[0],
        command=command,
        data=data,
        source="shipped default (worker/quality/default_head.py)",
        figures=figures,
        fitted_on_reporting_sets=[name for name in REPORTING if name not in unseen],
        never_fitted_on=unseen,
    )
    return shipped
