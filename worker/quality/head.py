"""A trained scorer head: label scores from the ticket's pooled hidden state instead of label tokens.

Same single bucketed forward pass as prompt scoring; only the last step differs.
Features are standardized (mean/std of the training states: LM hidden states have a
few huge outlier dimensions), L2-normalized to norm sqrt(H), then scored linearly:
``logits = W z + b``. Joined features (an LM's states next to an encoder's embedding)
are normalized block by block (``blocks``: the width of each), each to norm
sqrt(its width), so neither model's scale drowns the other's. A head may be fitted on fine labels
and answer in coarse ones (``groups``: fine -> coarse, e.g. CLINC150's 150 intents -> 10 domains):
each coarse probability is the sum of its fine labels', so the head keeps the detail the fine
labels carry while the worker writes the labels its task names. Two fits produce that form:

* ``logreg``: multinomial logistic regression, L2 penalty picked by k-fold CV log-loss;
* ``centroid``: cosine to each class mean, times a temperature fitted by leave-one-out log-loss.

Saved as safetensors (tensors) with JSON metadata in the header: labels, pooling,
model, its weights' fingerprint, prompt hash. No pickle. A head only fits the prompt and model it was
trained with, so loading checks both (``check``): the model by its weights where the head recorded them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from worker.engine.results import softmax
from worker.engine.types import ConfigError
from worker.quality.fingerprint import KEY, backbone_fingerprint, model_mismatch
from worker.quality.head_file import FORMAT  # the preflight reads the same header without torch

DEFAULT_TEMPERATURE = 20.0  # cosine temperature when no class has two examples to fit it on
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


class HeadMismatch(ConfigError):
    """The head was fitted for another model, prompt or label set."""

    setting = "TRIAGE_HEAD_PATH"


def prompt_hash(clf) -> str:
    """Identifies the token ids around every ticket: hidden states depend on them."""
    t = clf.template
    parts = [list(t.prefix_ids), list(t.tail_ids)] + ([["lead"] + list(t.lead_ids)] if t.lead_ids else [])
    if clf.aux_framing is not None:  # joined features: the encoder's framing too
        aux = clf.aux_framing.template
        parts.append(["encoder"] + list(aux.lead_ids) + ["|"] + list(aux.tail_ids))
    blob = json.dumps(parts).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def head_meta(clf, source: str) -> dict:
    """What a head fitted on ``clf``'s pooled states records about them (``Head.check`` compares it on load);
    ``model_fingerprint`` (the weights, fingerprint.py) only where the backbones are files on disk."""
    fingerprint = backbone_fingerprint(clf)
    return {
        "model": clf.model_name,
        **({KEY: fingerprint} if fingerprint else {}),
        "prompt_hash": prompt_hash(clf),
        "dtype": clf.dtype_name,
        "source": source,
        "head_prompt": clf.head_prompt,
    }


@dataclass
class Head:
    labels: tuple[str, ...]
    pooling: str  # "mean" | "last"
    method: str  # "logreg" | "centroid"
    mean: np.ndarray  # [H]
    std: np.ndarray  # [H]
    weight: np.ndarray  # [J, H]
    bias: np.ndarray  # [J]
    meta: dict = field(default_factory=dict)  # model, prompt_hash, dtype, n_train, l2, ...

    @property
    def outputs(self) -> tuple[str, ...]:
        """The labels this head scores: its own, or the coarse labels its fine ones are summed into."""
        if not self.meta.get("groups"):
            return self.labels
        return tuple(self.meta["outputs"])

    def group_matrix(self) -> np.ndarray | None:
        """[fine, coarse] 0/1 matrix (None for an ungrouped head): fine probabilities @ it = coarse ones."""
        groups = self.meta.get("groups")
        if not groups:
            return None
        outputs = self.outputs
        m = np.zeros((len(self.labels), len(outputs)))
        for i, lab in enumerate(self.labels):
            m[i, outputs.index(groups[lab])] = 1.0
        return m

    def probs(self, x: np.ndarray) -> np.ndarray:
        """Probabilities over ``outputs`` (what the worker scores with this head)."""
        p = softmax(self.logits(x))
        m = self.group_matrix()
        return p if m is None else p @ m

    @property
    def blocks(self) -> tuple[int, ...]:
        """Widths of the feature blocks normalized separately (one block: a single model's states)."""
        return tuple(self.meta.get("blocks") or (self.mean.shape[0],))

    def transform(self, x: np.ndarray) -> np.ndarray:
        z = (np.asarray(x, dtype=np.float64) - self.mean) / self.std
        return normalize_blocks(z, self.blocks)

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.transform(x) @ self.weight.T + self.bias

    def check(self, clf) -> None:
        """Raise ``HeadMismatch`` unless ``clf`` runs the model, prompt and labels this head was fitted on."""
        problems = []
        if set(self.outputs) != set(clf.labels):
            problems.append(f"labels {sorted(self.outputs)} != task labels {sorted(clf.labels)}")
        if (why := model_mismatch(self.meta, clf)) is not None:  # the weights' fingerprint, else the model name
            problems.append(why)
        if self.meta.get("prompt_hash") != prompt_hash(clf):
            problems.append(
                "the prompt (instructions, the label names or their order, descriptions or few-shot examples) "
                "changed since fitting"
            )
        if self.mean.shape[0] != clf.feature_dim:
            problems.append(f"feature size {self.mean.shape[0]} != {clf.feature_dim}")
        want, have = self.meta.get("head_prompt"), clf.head_prompt
        if want and have and want != have:
            problems.append(f"fitted under the {want!r} prompt, this classifier uses {have!r} (TRIAGE_HEAD_PROMPT)")
        if problems:
            raise HeadMismatch(
                "scorer head does not fit this classifier: " + "; ".join(problems) + " (refit with `triage-worker fit`)"
            )

    def reordered(self, labels: Sequence[str]) -> Head:
        """The same head answering in the order of ``labels`` (a grouped head: the order of its coarse labels)."""
        if self.meta.get("groups"):
            if set(labels) != set(self.outputs):
                raise ValueError(f"cannot reorder {sorted(self.outputs)} as {sorted(labels)}")
            meta = dict(self.meta, outputs=list(labels))
            return Head(self.labels, self.pooling, self.method, self.mean, self.std, self.weight, self.bias, meta)
        idx = [self.labels.index(lab) for lab in labels]
        return Head(
            tuple(labels),
            self.pooling,
            self.method,
            self.mean,
            self.std,
            self.weight[idx],
            self.bias[idx],
            dict(self.meta),
        )

    # ----------------------------------------------------------------- io
    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        meta = dict(self.meta, format=FORMAT, labels=list(self.labels), pooling=self.pooling, method=self.method)
        tensors = {
            k: np.ascontiguousarray(v, dtype=np.float32)
            for k, v in (("mean", self.mean), ("std", self.std), ("weight", self.weight), ("bias", self.bias))
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a refit over a live head never leaves half a file
        try:
            save_file(tensors, str(tmp), metadata={"triage_head": json.dumps(meta)})
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600: unreadable to a container's other user
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> Head:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            raw = (f.metadata() or {}).get("triage_head")
            if raw is None:
                raise ValueError(f"{path}: not a triage scorer head (no 'triage_head' metadata)")
            meta = json.loads(raw)
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: unsupported head format {meta.get('format')!r} (want {FORMAT})")
            t = {k: f.get_tensor(k).astype(np.float64) for k in ("mean", "std", "weight", "bias")}
        labels = tuple(meta.pop("labels"))
        return cls(labels, meta.pop("pooling"), meta.pop("method"), t["mean"], t["std"], t["weight"], t["bias"], meta)


def normalize_blocks(z: np.ndarray, blocks: Sequence[int]) -> np.ndarray:
    """Each block of columns rescaled to norm sqrt(its width) (per row)."""
    out = np.empty_like(z)
    start = 0
    for width in blocks:
        part = z[:, start : start + width]
        out[:, start : start + width] = part * (
            np.sqrt(width) / np.maximum(np.linalg.norm(part, axis=1, keepdims=True), 1e-12)
        )
        start += width
    if start != z.shape[1]:
        raise ValueError(f"feature blocks {list(blocks)} do not add up to {z.shape[1]} columns")
    return out


# ---------------------------------------------------------------------- fitting
def fit_head(
    x: np.ndarray,
    y: Sequence[str],
    labels: Sequence[str],
    *,
    method: str = "logreg",
    pooling: str = "mean",
    l2: float | None = None,
    meta: dict | None = None,
    seed: int = 0,
    blocks: Sequence[int] | None = None,
    groups: dict[str, str] | None = None,
    outputs: Sequence[str] | None = None,
) -> Head:
    """Fit on pooled states ``x`` [N, H] with string labels ``y``; every label needs >= 1 example.

    ``blocks``: widths of separately normalized feature blocks (joined features), default one block.
    ``groups``: fine label -> coarse label for every one of ``labels`` (fine); the head then answers
    in ``outputs`` (the coarse labels, in that order; default: first-seen order of ``groups``).
    """
    labels = tuple(labels)
    index = {lab: j for j, lab in enumerate(labels)}
    missing = [lab for lab in labels if lab not in set(y)]
    if missing:
        raise ValueError(f"no training examples for labels {missing}")
    yi = np.array([index[v] for v in y])
    x = np.asarray(x, dtype=np.float64)
    mu = x.mean(0)
    sd = x.std(0) + 1e-6 * (x.std(0).max() + 1e-12) + 1e-12
    meta = dict(meta or {})
    if blocks is not None and len(blocks) > 1:
        meta["blocks"] = [int(b) for b in blocks]
    if groups:
        meta.update(_group_meta(labels, groups, outputs))
    head = Head(labels, pooling, method, mu, sd, np.zeros((len(labels), x.shape[1])), np.zeros(len(labels)), meta)
    z = head.transform(x)
    if method == "centroid":
        head.weight, scale = _fit_centroid(z, yi, len(labels))
        head.meta["temperature"] = round(float(scale), 4)
    elif method == "logreg":
        if l2 is None:
            l2 = _pick_l2(z, yi, len(labels), seed)
        head.weight, head.bias = _fit_logreg(z, yi, len(labels), l2)
        head.meta["l2"] = l2
    else:
        raise ValueError(f"unknown head method {method!r} (logreg or centroid)")
    head.meta.update(n_train=int(len(yi)), per_label={lab: int((yi == j).sum()) for lab, j in index.items()})
    return head


def fit_head_for(
    x: np.ndarray, y: Sequence[str], labels: Sequence[str], *, groups: dict[str, str] | None = None, **kwargs
) -> Head:
    """A head answering in ``labels``: ``fit_head(x, y, labels)``, or with ``groups`` (fine label -> one of
    ``labels``, e.g. ``data.Source.groups()``) ``y`` holds the fine labels: the head is fitted on the fine labels
    ``y`` has (sorted) and each of ``labels`` is the sum of its fine labels' probabilities (``fit --fine-labels``,
    ``eval --fine-labels``, the quality table's every-row CLINC150 head)."""
    if not groups:
        return fit_head(x, y, labels, **kwargs)
    return fit_head(x, y, sorted(set(y)), groups=groups, outputs=labels, **kwargs)


def _group_meta(labels: Sequence[str], groups: dict[str, str], outputs: Sequence[str] | None) -> dict:
    unmapped = [lab for lab in labels if lab not in groups]
    if unmapped:
        raise ValueError(f"fine labels without a coarse label: {unmapped[:10]}")
    outputs = list(outputs) if outputs is not None else list(dict.fromkeys(groups[lab] for lab in labels))
    empty = sorted(set(outputs) - {groups[lab] for lab in labels})
    if empty or len(set(outputs)) != len(outputs):
        raise ValueError(f"coarse labels without a fine label (or repeated): {empty or outputs}")
    stray = sorted({groups[lab] for lab in labels} - set(outputs))
    if stray:
        raise ValueError(f"fine labels map to coarse labels outside {outputs}: {stray[:10]}")
    return {"groups": {lab: groups[lab] for lab in labels}, "outputs": outputs}


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)


def _fit_centroid(z: np.ndarray, y: np.ndarray, j: int) -> tuple[np.ndarray, float]:
    """Unit class means, and the cosine temperature minimising leave-one-out log-loss."""
    zu = _unit(z)
    sums = np.stack([zu[y == k].sum(0) for k in range(j)])
    counts = np.bincount(y, minlength=j)
    cos = zu @ _unit(sums).T  # [N, J]
    own = sums[y] - zu  # leave-one-out sum of each item's own class
    loo = np.einsum("nh,nh->n", zu, _unit(own))
    ok = counts[y] > 1  # leave-one-out needs a second example of the item's class
    cos_loo = cos[ok].copy()
    cos_loo[np.arange(ok.sum()), y[ok]] = loo[ok]
    best, best_s = np.inf, DEFAULT_TEMPERATURE
    for s in np.geomspace(1.0, 200.0, 40) if ok.any() else ():
        nll = -_log_softmax(s * cos_loo)[np.arange(ok.sum()), y[ok]].mean()
        if nll < best:
            best, best_s = nll, s
    dim = z.shape[1]
    return best_s * _unit(sums) / np.sqrt(dim), best_s


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(axis=1, keepdims=True)
    return a - np.log(np.exp(a).sum(axis=1, keepdims=True))


def _fit_logreg(z: np.ndarray, y: np.ndarray, j: int, l2: float, iters: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Mean cross-entropy + l2/2 * ||W||^2 (bias unpenalised), full-batch L-BFGS in float64 (deterministic)."""
    x = torch.from_numpy(z)
    t = torch.from_numpy(y).long()
    w = torch.zeros(j, z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(j, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [w, b], lr=1.0, max_iter=iters, tolerance_grad=1e-7, tolerance_change=1e-10, line_search_fn="strong_wolfe"
    )
    scale = 1.0 / z.shape[1]  # features have norm sqrt(H): keep logits O(1) at the start

    def closure():
        opt.zero_grad()
        loss = (
            torch.nn.functional.cross_entropy(x @ w.T * scale + b, t) + 0.5 * l2 * (w * scale).pow(2).sum() * z.shape[1]
        )
        loss.backward()
        return loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool costs ~50x here on a busy CPU (measured)
    try:
        with torch.enable_grad():
            opt.step(closure)
    finally:
        torch.set_num_threads(threads)
    return (w.detach() * scale).numpy(), b.detach().numpy()


def _pick_l2(z: np.ndarray, y: np.ndarray, j: int, seed: int, folds: int = 3) -> float:
    """k-fold CV log-loss over ``L2_GRID``; a middle value when some label has fewer than ``folds`` examples."""
    counts = np.bincount(y, minlength=j)
    if counts.min() < folds:
        return 1e-2
    rng = np.random.default_rng(seed)
    fold = np.zeros(len(y), dtype=int)
    for k in range(j):  # stratified: each label spread over the folds
        idx = np.flatnonzero(y == k)
        fold[rng.permutation(idx)] = np.arange(len(idx)) % folds
    best, best_l2 = np.inf, 1e-2
    for l2 in L2_GRID:
        loss = 0.0
        for f in range(folds):
            tr, te = fold != f, fold == f
            w, b = _fit_logreg(z[tr], y[tr], j, l2, iters=100)
            loss -= _log_softmax(z[te] @ w.T + b)[np.arange(te.sum()), y[te]].sum()
        if loss < best:
            best, best_l2 = loss, l2
    return best_l2


# ---------------------------------------------------------------------- scoring
class HeadScorer:
    """The engine's ``Scorer`` protocol over a fitted head (no label tokens, no KV cache kept)."""

    kind = "head"
    needs_cache = False

    def __init__(self, head: Head, device: torch.device | str = "cpu", source: str | None = None):
        self.head = head
        self.source = source  # the head file, or "task examples" (fitted at start-up)
        self.names = head.outputs
        self.needs_mean = head.pooling == "mean"
        f32 = lambda a: torch.tensor(a, dtype=torch.float32, device=device)  # noqa: E731
        self._mu, self._sd = f32(head.mean), f32(head.std)
        self._w, self._b, self._blocks = f32(head.weight), f32(head.bias), list(head.blocks)
        groups = head.group_matrix()
        self._groups = None if groups is None else f32(groups)

    @torch.inference_mode()
    def scores(self, model, fwd) -> torch.Tensor:
        x = (fwd.h_mean if self.needs_mean else fwd.h_last).float().to(self._mu.device)
        z = (x - self._mu) / self._sd
        parts = z.split(self._blocks, dim=1)
        z = torch.cat(
            [p * (float(np.sqrt(p.shape[1])) / p.norm(dim=1, keepdim=True).clamp(min=1e-12)) for p in parts], 1
        )
        out = torch.log_softmax(z @ self._w.T + self._b, dim=-1)
        if self._groups is None:
            return out
        return torch.log((out.exp() @ self._groups).clamp(min=1e-30))  # coarse = sum of its fine labels
