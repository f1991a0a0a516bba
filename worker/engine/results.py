"""From a pass's log-scores to what the engine hands back: probabilities, the decided label, the pass's cost.

Kept apart from ``classifier.py`` (the model and its forward calls) because none of it needs
torch: it is numpy on host arrays, so the rules here (threshold + fallback, what a pass is
charged for, input order) read and test on their own, and quality code can reuse them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from worker.engine.bucketing import Pass
from worker.engine.types import PassStats, Prediction, Prepared, RunStats

if TYPE_CHECKING:
    from worker.engine.launch import LaunchedPass

# One pass's answer as ``Classifier.classify_passes`` yields it: (indices into items, their predictions, its cost).
PassOutput = tuple[tuple[int, ...], list[Prediction], PassStats]


def softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def decide(probs: np.ndarray, names: Sequence[str], threshold: float, fallback: str) -> list[str]:
    """The label written for each row: the most probable, or ``fallback`` when its probability is under
    ``threshold`` (TRIAGE_CONFIDENCE_THRESHOLD / TRIAGE_FALLBACK_LABEL; eval picks thresholds with this too)."""
    top = probs.argmax(axis=1)
    low = probs[np.arange(len(probs)), top] < threshold
    return [fallback if u else names[k] for k, u in zip(top.tolist(), low.tolist())]


class NonFiniteScores(ValueError):
    """A pass's label scores hold NaN or infinity: a numeric overflow in the model (fp16 can overflow where bf16
    and fp32 do not). Raised for the whole pass, so its tickets are re-run one by one (``isolation``) and only
    a ticket that overflows alone is dead-lettered, with this as the reason: never written as a label."""


def predictions(
    log_scores: np.ndarray, items: Sequence[Prepared], names: Sequence[str], threshold: float, fallback: str
) -> list[Prediction]:
    """One ``Prediction`` per row of calibrated [B, J] log-scores (the score bias already subtracted)."""
    finite = np.isfinite(log_scores).all(axis=1)
    if not finite.all():
        raise NonFiniteScores(
            f"the model's label scores are not finite (NaN or inf) for {int((~finite).sum())} of {len(finite)} "
            "tickets: a numeric overflow; TRIAGE_DTYPE=bf16 or fp32 avoids those fp16 causes"
        )
    probs = softmax(log_scores)
    decided = decide(probs, names, threshold, fallback)
    return [
        Prediction(label=label, scores=dict(zip(names, row)), truncated=p.truncated, n_tokens=p.n_text_tokens)
        for row, label, p in zip(probs.tolist(), decided, items)
    ]


def pass_cost(
    b: Pass, launched: LaunchedPass, post_ms: float, *, packed: bool, pad_to: int | None, prefix_tokens: int
) -> PassStats:
    """What pass ``b`` cost: a packed pass computes its real tokens and those a CUDA graph's rounded shape added
    (``launched.extra_tokens``: charged as real, the padding, computed tokens and HFU read as if none were added),
    a padded one every row at its widest (or ``pad_to``); ``prefix_tokens`` per row were read from the cache;
    ``post_ms`` of host postprocess."""
    return PassStats(
        items=b.size,
        real_tokens=b.real_tokens,
        padded_tokens=b.real_tokens + launched.extra_tokens if packed else b.size * max(b.max_len, pad_to or 0),
        prefix_tokens_reused=prefix_tokens * b.size,
        infer_ms=launched.wall_ms,
        gpu_ms=launched.gpu_ms,
        host_ms=launched.host_ms + post_ms,
    )


def in_input_order(results: Iterable[PassOutput], n: int) -> tuple[list[Prediction], RunStats]:
    """All passes' predictions back in input order (``n`` items), and their stats added up."""
    preds: list[Prediction | None] = [None] * n
    stats = RunStats()
    for indices, chunk, cost in results:
        for i, p in zip(indices, chunk):
            preds[i] = p
        stats.add(cost)
    stats.items = n
    return preds, stats  # type: ignore[return-value]
