"""The planner's price of one forward call, measured on this model and device (``TRIAGE_PASS_OVERHEAD_TOKENS=auto``).

Why measure: a pass costs a fixed part (Python, kernel launches, setting up attention to the prompt
prefix) plus a part per token, and their ratio differs by an order of magnitude between the models
and boxes this runs on. Measured here (2-core Xeon, bf16): 130-200 token-equivalents for SmolLM2-135M,
~190 for all-MiniLM-L6-v2, 460-970 for the tests' one-layer model, against a fixed guess of 32 that cut
a small, fast model's windows into 1.7x as many passes as they needed (docs/worker.md, "Pass overhead").
Measured as ``dtype=auto`` is: a few timed passes of the classifier's own path at start-up, the best
of each kept (a busy box only ever slows a pass).
"""

from __future__ import annotations

import dataclasses
import time

from worker.engine.types import Prepared

ROW_TOKENS = 32  # text tokens of the synthetic row: a short ticket
ROWS = 4  # rows of the larger timed pass (8 measured the same, at 1.7x the start-up time: 1.7 s for SmolLM2 here)
REPEATS = 3
# The setting's default: the price before a measurement, for classifiers that are not timed (feature
# extraction), and where a pass cap of one ticket leaves nothing to trade.
FALLBACK_TOKENS = 32


def overhead_tokens(one_row_s: float, rows_s: float, row_tokens: int, rows: int, cap: int) -> int:
    """Fixed cost / cost per token, from the same row timed alone and ``rows`` times in one pass, within [0, cap].

    A pass of more rows that costs no more says the fixed part is all there is: ``cap`` (fill every pass)."""
    per_token_s = (rows_s - one_row_s) / ((rows - 1) * row_tokens)
    if per_token_s <= 0:
        return cap
    fixed_s = one_row_s - per_token_s * row_tokens
    return int(min(cap, max(0, round(fixed_s / per_token_s))))


def measured_here(requested: int | str, device) -> bool:
    """Whether ``TRIAGE_PASS_OVERHEAD_TOKENS=requested`` is timed on ``device``: ``auto`` off CUDA (on CUDA
    ``auto`` means the packed path's default, which ignores the price)."""
    return requested == "auto" and getattr(device, "type", str(device)) != "cuda"


def resolve(clf, requested: int | str):
    """``clf`` with ``auto`` resolved where it is measured: timed on its own passes, scorer included (the builder
    calls this on the classifier it returns). A set number, or CUDA's default, stays as ``clf`` has it."""
    if measured_here(requested, clf.device):
        clf.options = dataclasses.replace(clf.options, pass_overhead_tokens=measure(clf))
    return clf


def measure(clf, repeats: int = REPEATS) -> int:
    """Token-equivalents of one forward call of ``clf`` (its own ``run_pass``, so what the worker runs is timed)."""
    o = clf.options
    row = synthetic_row(clf)
    tokens = clf.cost_length(row)
    rows = min(ROWS, o.pass_max_items, o.pass_max_tokens // tokens)
    if rows < 2:
        return FALLBACK_TOKENS
    _seconds(clf, [row] * rows)  # untimed: a fresh model's first pass of a shape pays lazy set-up (kernel choice)
    best_one = best_rows = float("inf")
    for _ in range(repeats):  # interleaved: a slow spell of the box hits both sizes alike
        best_one = min(best_one, _seconds(clf, [row]))
        best_rows = min(best_rows, _seconds(clf, [row] * rows))
    return overhead_tokens(best_one, best_rows, tokens, rows, o.pass_max_tokens)


def synthetic_row(clf) -> Prepared:
    """A prepared ticket of ``ROW_TOKENS`` text tokens (fewer where the input limit is lower), framed as any ticket."""
    text = ["account " * ROW_TOKENS]
    ids = clf.framing.tokenize(text)[0][:ROW_TOKENS]
    aux = clf.aux_framing
    return Prepared(
        ids=clf.framing.frame(ids),
        n_text_tokens=min(len(ids), clf.framing.limit),
        truncated=False,
        aux_ids=aux.frame(aux.tokenize(text)[0][:ROW_TOKENS]) if aux is not None else (),
    )


def _seconds(clf, items) -> float:
    t0 = time.perf_counter()
    clf.run_pass(items)  # waits for the scores: on every device the pass has finished when it returns
    return time.perf_counter() - t0
