"""CUDA graphs of full passes, captured at start-up instead of in a fresh worker's first busy windows.

A packed pass replays a graph per shape (``graphs.shape_for``: tokens, rows, longest row); capturing
a shape costs about four forwards of its pass, paid in the serving path when the shape is met (on its
second pass, ``graphs.Sightings``). Under load almost every pass is *full* (the planner fills each up
to the token cap, shortest tickets first), and full passes come in few shapes: rows no longer than L
(a power of two) fill ``max_tokens`` with between max_tokens/L and about 4 * max_tokens/L of them.
``full_pass_shapes`` lists those; ``warm_up`` runs one synthetic pass of each through the classifier's
own path, so each is captured and checked before ``worker_ready``, as serving engines capture their
batch sizes at start-up. Other shapes (a window's last, partial pass; a run of rows all within a token
or two of L, which dense traffic at small caps makes; a joined encoder's passes, whose rows also count
the encoder's tokens) are captured when they come back.
Nothing runs where no graphs are used (CPU, MPS, eager kernels).
"""

from __future__ import annotations

import dataclasses
import time

from worker.engine.bucketing import Pass
from worker.engine.graphs import next_pow2, round_tokens, shape_for
from worker.engine.packed import Layout

MIN_ROWS, MIN_LONGEST = 8, 64  # shape_for's floors


def full_pass_shapes(max_tokens: int, max_items: int, max_row: int) -> list[tuple[int, int, int]]:
    """(tokens, rows, longest) of the passes the token cap fills, for rows of at most ``max_row`` tokens.

    Rows of a full pass are a sorted run: its longest row sets L; a run whose rows are all in (L/2, L]
    has more than ``max_tokens/L`` and up to ``2 * max_tokens/L`` rows, and one that starts below L/2
    (a run across a power of two) up to twice that again. Item-capped passes (rows averaging under
    max_tokens/max_items tokens) are left out: their token count follows the traffic."""
    shapes = []
    longest, top = MIN_LONGEST, next_pow2(max_row, MIN_LONGEST)
    row_cap = next_pow2(max_items, MIN_ROWS)
    while longest <= top:
        fewest = next_pow2(max_tokens // longest + 1, MIN_ROWS)
        tokens = sorted({round_tokens(max(1, max_tokens - longest + 1)), round_tokens(max_tokens)})
        for rows in (fewest, 2 * fewest):
            if rows <= row_cap:
                shapes += [(t, rows, longest) for t in tokens]
        longest *= 2
    return sorted(set(shapes))


def lengths_for(shape: tuple[int, int, int], max_row: int, max_items: int) -> list[int] | None:
    """Row lengths of a synthetic pass that replays at ``shape`` (None if no pass within the caps does)."""
    tokens, rows, longest = shape
    n = min(rows, max_items)
    first = min(longest, max_row)
    rest = min(first, (tokens - first) // (n - 1)) if n > 1 else 0
    lengths = [first] + [rest] * (n - 1)
    if rest < 1 or shape_for(Layout.build(lengths)) != shape:
        return None
    return lengths


def warm_up(clf) -> dict | None:
    """Capture the full-pass graphs of ``clf`` (one synthetic pass each); what it took, or None without graphs."""
    runner = clf.graph_runner()
    if runner is None or clf.attention != "packed":
        return None
    o = clf.options
    carried = 0 if clf.use_prefix_cache else clf.prefix_length  # without the cache each row carries the prefix
    max_row = clf.framing.max_row + carried
    base = clf.prepare_valid(["warm-up ticket"])[0]
    items: list = []
    plan: list[Pass] = []
    for shape in full_pass_shapes(o.pass_max_tokens, o.pass_max_items, max_row):
        lengths = lengths_for(shape, max_row, o.pass_max_items)
        if lengths is not None and min(lengths) > carried:
            indices = tuple(range(len(items), len(items) + len(lengths)))
            items += [dataclasses.replace(base, ids=_cycle(base.ids, n - carried)) for n in lengths]
            plan.append(Pass(indices, tuple(clf.cost_length(items[i]) for i in indices)))
    before = runner.captures
    wall_s = capture_plan(clf, items, plan)
    return {"passes": len(plan), "captures": runner.captures - before, "wall_s": wall_s}


def capture_plan(clf, items, plan) -> float:
    """Run ``plan`` once, every new shape captured at its first sight (a warm-up runs each shape once, to be
    replayed later); the seconds it took. The worker's start-up and the bench's warm-ups both run this."""
    t0 = time.perf_counter()
    with clf.graph_runner().capturing_at_first_sight():
        for _ in clf.classify_passes(items, plan):
            pass
    return round(time.perf_counter() - t0, 3)


def _cycle(ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    return (ids * (n // len(ids) + 1))[:n]
