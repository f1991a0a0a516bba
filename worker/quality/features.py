"""Pooled hidden states from the engine's own bucketed forward passes, with a progress bar.

``FeatureTap`` wraps the classifier's scorer in a copy of the classifier
(``with_scoring``): the same single forward pass yields the prompt scores *and* the
pooled states a head is fitted on, so an eval scores the prompt and the head on one
forward per ticket.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from worker.engine.classifier import Classifier
from worker.engine.types import Prepared


class PoolOnly:
    """A scorer that only asks for the pooled states (no label scoring, no KV cache kept)."""

    kind = "features"
    needs_cache = False
    needs_mean = True

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)

    def scores(self, model, fwd) -> torch.Tensor:
        return torch.zeros(fwd.h_last.shape[0], len(self.names))


class FeatureTap:
    """Delegates scoring to ``inner`` and keeps each pass's last-token and mean-pooled states."""

    needs_mean = True

    def __init__(self, inner):
        self.inner = inner
        self.kind = inner.kind
        self.names = inner.names
        self.needs_cache = inner.needs_cache
        self.last: list[np.ndarray] = []
        self.mean: list[np.ndarray] = []

    def scores(self, model, fwd) -> torch.Tensor:
        self.last.append(fwd.h_last.float().cpu().numpy())
        self.mean.append(fwd.h_mean.float().cpu().numpy())
        return self.inner.scores(model, fwd)


@dataclass
class Features:
    """Scores and pooled states of a list of items, in input order (all the passes of one run)."""

    log_scores: np.ndarray  # [N, J] raw scorer output (before score_bias)
    last: np.ndarray  # [N, H] hidden state at the last real token (end of the answer cue)
    mean: np.ndarray  # [N, H] mean over the ticket + answer-cue tokens
    seconds: float = 0.0  # forward time when it was computed (also when loaded from the cache)
    cached: bool = False

    def pooled(self, pooling: str) -> np.ndarray:
        return self.mean if pooling == "mean" else self.last


def _cache_key(clf: Classifier, items: Sequence[Prepared], score: bool) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps(
            [clf.model_name, clf.dtype_name, str(clf.device), score, list(clf.labels), list(clf.template.prefix_ids)]
        ).encode()
    )
    for p in items:
        h.update(np.asarray(p.ids, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()[:24]


def run_features(
    clf: Classifier,
    items: Sequence[Prepared],
    *,
    score: bool = True,
    desc: str = "forward",
    progress: bool = True,
    cache_dir: Path | None = None,
) -> Features:
    """Length-bucketed passes exactly as ``clf.classify`` plans them, one ``run_pass`` each.

    ``score=False`` skips label scoring (features only: cheaper with multi-token labels).
    ``cache_dir`` keeps results as .npz keyed by model, dtype, prompt and token ids, so a
    re-run with other head or calibration options skips the forward passes.
    """
    path = Path(cache_dir) / f"pass-{_cache_key(clf, items, score)}.npz" if cache_dir else None
    if path is not None and path.is_file():
        with np.load(path, allow_pickle=False) as z:
            secs = float(z["seconds"]) if "seconds" in z.files else 0.0
            return Features(log_scores=z["log_scores"], last=z["last"], mean=z["mean"], seconds=secs, cached=True)
    t0 = time.perf_counter()
    out = _run(clf, items, score, desc, progress)
    out.seconds = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, log_scores=out.log_scores, last=out.last, mean=out.mean, seconds=np.float64(out.seconds))
        tmp.replace(path)
    return out


def _run(clf: Classifier, items: Sequence[Prepared], score: bool, desc: str, progress: bool) -> Features:
    from worker.progress import Progress

    passes = clf.plan(items)
    tap = FeatureTap(clf.scorer if score else PoolOnly(clf.labels))
    tapped = clf.with_scoring(tap)
    n, j = len(items), len(clf.labels)
    scores = np.zeros((n, j))
    last: np.ndarray | None = None
    mean: np.ndarray | None = None
    with Progress(n, desc, enabled=progress, leave=False) as bar:
        for b in passes:
            idx = list(b.indices)
            scores[idx] = tapped.run_pass([items[i] for i in idx])
            h_last, h_mean = tap.last.pop(), tap.mean.pop()
            if last is None:
                last = np.zeros((n, h_last.shape[1]), dtype=np.float32)
                mean = np.zeros((n, h_mean.shape[1]), dtype=np.float32)
            last[idx], mean[idx] = h_last, h_mean
            bar.update(len(idx))
    if last is None:
        raise ValueError("no items to run")
    return Features(log_scores=scores, last=last, mean=mean)


class FeatureStore:
    """Pooled states per ticket on disk, so re-fits and new tables never run a ticket through the model twice.

    One folder per (model, dtype, prompt) under ``root``; each call that computes new tickets adds one
    ``.npz`` shard (ticket keys = a hash of the ticket's token ids, plus its mean and last states).
    Unlike ``run_features``'s cache (one file per exact list of tickets), any subset or superset of
    already-seen tickets is served from here.
    """

    def __init__(self, root: Path, clf: Classifier):
        from worker.quality.head import prompt_hash

        self.clf = clf
        spec = [clf.model_name, clf.dtype_name, str(clf.device), prompt_hash(clf)]
        self.dir = Path(root) / hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:20]
        self._mean: dict[str, np.ndarray] = {}
        self._last: dict[str, np.ndarray] = {}
        self.computed = 0  # tickets run through the model by this store (the rest came from disk)
        if self.dir.is_dir():
            for shard in sorted(self.dir.glob("shard-*.npz")):
                with np.load(shard, allow_pickle=False) as z:
                    for k, m, last in zip(z["keys"].tolist(), z["mean"], z["last"]):
                        self._mean[k], self._last[k] = m, last

    @staticmethod
    def _key(p: Prepared) -> str:
        return hashlib.sha256(np.asarray(p.ids, dtype=np.int64).tobytes()).hexdigest()[:24]

    def get(self, texts: Sequence[str], *, desc: str = "features", progress: bool = True) -> Features:
        items = self.clf.prepare_valid(list(texts))
        keys = [self._key(p) for p in items]
        todo = sorted({k: i for i, k in enumerate(keys) if k not in self._mean}.values())
        secs = 0.0
        if todo:
            out = run_features(self.clf, [items[i] for i in todo], score=False, desc=desc, progress=progress)
            secs = out.seconds
            new_keys = [keys[i] for i in todo]
            for k, m, last in zip(new_keys, out.mean, out.last):
                self._mean[k], self._last[k] = m, last
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "spec.json").write_text(
                json.dumps({"model": self.clf.model_name, "dtype": self.clf.dtype_name})
            )
            shard = self.dir / f"shard-{int(time.time() * 1000)}-{len(todo)}.npz"
            tmp = shard.with_suffix(".tmp.npz")
            np.savez(tmp, keys=np.array(new_keys), mean=out.mean, last=out.last)
            tmp.replace(shard)
            self.computed += len(todo)
        mean = np.stack([self._mean[k] for k in keys])
        last = np.stack([self._last[k] for k in keys])
        return Features(log_scores=np.zeros((len(keys), 0)), last=last, mean=mean, seconds=secs, cached=not todo)
