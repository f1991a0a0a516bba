"""Check that speed never changes answers: production path vs an unpadded one-at-a-time reference.

Production = length buckets + padding + shared prefix KV cache. Reference = each
ticket alone, no padding, no prefix cache, same model and dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

from worker.engine.classifier import Classifier
from worker.engine.types import Prediction, Prepared

# fp32: the largest |probability difference| from the reference that passes. The paths differ only in summation
# order (2.4e-6 measured on SmolLM2, README); a sliding window the fast path ignored moved them by 4e-3.
FP32_TOLERANCE = 1e-4


@dataclass
class Disagreement:
    index: int
    id: str
    batched_label: str
    reference_label: str
    reference_margin: float  # top-1 minus top-2 probability in the reference
    max_abs_delta: float


@dataclass
class VerifyReport:
    n: int
    dtype: str
    device: str
    prefix_cache: bool
    agreement_pct: float
    max_abs_delta_prob: float
    padding_pct: float
    passes: int
    batched_items_per_s: float
    reference_items_per_s: float
    speedup: float
    disagreements: list[Disagreement] = field(default_factory=list)
    attention: str = "padded"  # the production path checked: "padded" or "packed" (the reference is always padded)
    # passes answered by CUDA graph replays (None: no graphs here). The worker captures a shape when it comes back;
    # verify captures at first sight, so the answers it checks are the replays a busy worker gives.
    cuda_graph_passes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def passed(self, flip_margin: float) -> bool:
        """fp32 must agree fully, every probability within ``FP32_TOLERANCE`` (a path that computes something
        else than the model moves probabilities long before it flips a label); lower precision may flip only
        near-ties (reference margin < flip_margin)."""
        if self.dtype == "fp32":
            return not self.disagreements and self.max_abs_delta_prob <= FP32_TOLERANCE
        return all(d.reference_margin < flip_margin for d in self.disagreements)


def top2_margin(p: Prediction) -> float:
    vals = sorted(p.scores.values(), reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else 1.0


def verify(
    clf: Classifier,
    items: Sequence[Prepared],
    ids: Sequence[str],
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    runner = clf.graph_runner()  # CUDA graphs (None elsewhere): every pass checked here comes from one
    before = runner.captures + runner.replays if runner is not None else 0
    t0 = time.perf_counter()
    with runner.capturing_at_first_sight() if runner is not None else nullcontext():
        batched, stats = clf.classify(items)
    t_batched = time.perf_counter() - t0
    graph_passes = runner.captures + runner.replays - before if runner is not None else None

    t0 = time.perf_counter()
    reference = []
    for p in items:
        reference.extend(clf.reference([p]))
        if progress:
            progress(1)
    t_ref = time.perf_counter() - t0

    disagreements, max_delta, agree = [], 0.0, 0
    for i, (b, r) in enumerate(zip(batched, reference)):
        delta = max(abs(b.scores[k] - r.scores[k]) for k in r.scores)
        max_delta = max(max_delta, delta)
        if b.label == r.label:
            agree += 1
        else:
            disagreements.append(Disagreement(i, str(ids[i]), b.label, r.label, top2_margin(r), delta))
    n = len(items)
    b_rate = n / t_batched if t_batched else float("inf")
    r_rate = n / t_ref if t_ref else float("inf")
    return VerifyReport(
        n=n,
        dtype=clf.dtype_name,
        device=str(clf.device),
        prefix_cache=clf.use_prefix_cache,
        agreement_pct=100.0 * agree / n if n else 100.0,
        max_abs_delta_prob=max_delta,
        padding_pct=stats.padding_pct,
        passes=stats.passes,
        batched_items_per_s=b_rate,
        reference_items_per_s=r_rate,
        speedup=b_rate / r_rate if r_rate else float("inf"),
        disagreements=disagreements,
        attention=clf.attention,
        cuda_graph_passes=graph_passes,
    )
