"""The batching strategies the benchmark compares, each driving the same engine on the same tickets.

Every mode is a batch plan + (prefix cache on/off, pad-to width) handed to
``Classifier.classify`` one pass at a time, so the engine's own code path runs
and each batch's wall time is seen (progress bar, per-ticket latency).

Latency, as reported: ``batch_ms`` is the wall time of the forward pass that
produced a ticket's result (batch start -> batch end, shared by all its
tickets; for the sequential mode, the ticket's own pass). ``done_s`` is the
mode's own elapsed time (its batches only, in plan order) until that ticket's
result exists, as for a backlog that arrived all at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from worker.bench.encoder_tokens import lm_tokens
from worker.engine import bucketing


@dataclass(frozen=True)
class ModeSpec:
    key: str
    title: str
    cached: bool | None  # shared prefix KV cache on; None = what the worker runs (TRIAGE_PREFIX_CACHE)
    global_pad: bool = False  # pad every batch to the longest ticket of the whole set
    attention: str | None = "padded"  # baselines run padded; None = what the worker runs (the classifier's)


MODES: dict[str, ModeSpec] = {
    "sequential": ModeSpec("sequential", "1 sequential (1/pass, no cache)", cached=False),
    "global_pad": ModeSpec("global_pad", "2 arrival, pad to global max", cached=False, global_pad=True),
    "arrival": ModeSpec("arrival", "3 arrival, pad to batch max", cached=False),
    "bucketed": ModeSpec("bucketed", "4 length buckets, no cache", cached=False),
    # mode 5: the worker's own passes, attention and prefix cache (the key names the default, cache on)
    "bucketed_cached": ModeSpec("bucketed_cached", "5 length buckets + prefix cache", cached=None, attention=None),
}
MODE_ORDER = tuple(MODES)
PACKED_TITLE = "5 packed + shared prefix"  # mode 5's title when the worker's attention is packed
NO_CACHE_TITLES = {"padded": "5 buckets, prefix cache off", "packed": "5 packed, prefix cache off"}  # mode 5's


def cached(spec: ModeSpec, clf) -> bool:
    """Whether ``spec`` runs with the shared prefix cache: its own choice, or (mode 5) the worker's setting."""
    return clf.use_prefix_cache if spec.cached is None else spec.cached


def title(spec: ModeSpec, clf) -> str:
    if spec.attention is None and not cached(spec, clf):  # TRIAGE_PREFIX_CACHE=false: mode 5 runs without it too
        return NO_CACHE_TITLES[clf.attention]
    if spec.attention is None and clf.attention == "packed":
        return PACKED_TITLE
    return spec.title


@dataclass
class ModeRun:
    key: str
    title: str
    cached: bool
    pad_to: int | None
    passes: list[bucketing.Pass]
    preds: list  # Prediction per ticket, input order (None: not run, see ``subsample``)
    attention: str = "padded"  # what the passes ran: "padded" or "packed"
    batch_s: list[float] = field(default_factory=list)  # wall time per batch, plan order
    done_s: list[float] = field(default_factory=list)  # per ticket, input order
    item_batch_s: list[float] = field(default_factory=list)  # per ticket, input order
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (all threads): robust to other load on a shared machine
    real_tokens: int = 0  # the LM's tokens without padding (prefix included when not cached)
    computed_tokens: int = 0  # what the LM's forward passes ran, padding (and a graph shape's rounding) included
    work_tokens: int = 0  # ticket suffix tokens only: the real work
    work_lengths: list[int] = field(default_factory=list)  # suffix tokens per ticket run (text + answer cue)
    prefix_tokens_recomputed: int = 0
    subsample: int | None = None  # only the first N tickets were run (the sequential mode on a large workload)
    pass_clocks: list[dict] = field(default_factory=list)  # per pass: items, tokens, wall_ms, host_ms, gpu_ms
    aux_lengths: list[int] = field(default_factory=list)  # joined features: encoder tokens per ticket, input order


def plan(
    clf,
    items: Sequence,
    spec: ModeSpec,
    fixed_batch: int,
    sequential_n: int | None = None,
    baseline_n: int | None = None,
) -> tuple[list[bucketing.Pass], int | None]:
    """The passes (indices into ``items``; lengths = cost lengths) and the pad-to width for a mode.

    Mode 5 is planned exactly as the worker plans (``clf.plan``: packed or padded, the classifier's
    caps, its prefix cache setting) over every ticket; the sequential mode runs only the first
    ``sequential_n`` tickets and modes 2-4 the first ``baseline_n`` when those are given (a large GPU workload).
    """
    lengths = [clf.cost_length(p, cached(spec, clf)) for p in items]
    if spec.key == "sequential":
        return [bucketing.Pass((i,), (n,)) for i, n in enumerate(lengths[:sequential_n])], None
    if spec.attention is not None:
        lengths = lengths[:baseline_n]
    if spec.key in ("global_pad", "arrival"):
        return bucketing.plan_arrival_order(lengths, fixed_batch), (max(lengths) if spec.global_pad else None)
    if spec.attention is None:
        return clf.plan(items, cached(spec, clf)), None
    o = clf.options
    return bucketing.plan_passes(lengths, o.pass_max_items, o.pass_max_tokens, o.pass_overhead_tokens), None


def run_modes(
    clf,
    items: Sequence,
    specs: Sequence[ModeSpec],
    fixed_batch: int,
    interleave: bool = True,
    on_batch: Callable[[int], None] = lambda n: None,
    sequential_n: int | None = None,
    baseline_n: int | None = None,
) -> dict[str, ModeRun]:
    """Run several modes over the same ``items``; ``on_batch(batch_size)`` after every forward pass.

    ``interleave``: always run the next batch of the mode that is least far through
    its planned (computed) tokens, so every mode meets the same load from other
    processes over the run instead of one mode drawing a quiet minute and another a
    busy one. Each mode's clocks (wall, CPU, ``done_s``) count only its own batches.
    Without it (a dedicated GPU), each mode runs its whole plan through
    ``Classifier.classify_passes``, as the worker does (one pass in flight on CUDA).
    """
    runs = {s.key: start(clf, items, s, *plan(clf, items, s, fixed_batch, sequential_n, baseline_n)) for s in specs}
    execute(clf, items, list(runs.values()), interleave, on_batch)
    return runs


def execute(
    clf,
    items: Sequence,
    runs: Sequence[ModeRun],
    interleave: bool = True,
    on_batch: Callable[[int], None] = lambda n: None,
) -> None:
    """Run the planned batches of every run (see ``run_modes`` for the interleaving rule)."""
    if not interleave:
        for run in runs:
            _stream(clf, items, run, on_batch)
        return
    todo = [list(r.passes) for r in runs]
    total = [max(1, sum(b.size * max(b.max_len, r.pad_to or 0) for b in r.passes)) for r in runs]
    spent = [0] * len(runs)
    while any(todo):
        live = [j for j in range(len(runs)) if todo[j]]
        j = min(live, key=lambda j: spent[j] / total[j])
        b = todo[j].pop(0)
        _step(clf, items, runs[j], b)
        spent[j] += b.size * max(b.max_len, runs[j].pad_to or 0)
        on_batch(b.size)


def run_mode(
    clf, items: Sequence, spec: ModeSpec, fixed_batch: int, on_batch: Callable[[int], None] = lambda n: None
) -> ModeRun:
    return run_modes(clf, items, [spec], fixed_batch, on_batch=on_batch)[spec.key]


def start(clf, items: Sequence, spec: ModeSpec, passes: list[bucketing.Pass], pad_to: int | None) -> ModeRun:
    """A run of ``spec`` over ``items`` with its passes planned, nothing executed yet."""
    run = ModeRun(
        spec.key,
        title(spec, clf),
        cached(spec, clf),
        pad_to,
        passes,
        preds=[None] * len(items),
        attention=spec.attention or clf.attention,
    )
    ran = sorted(i for b in passes for i in b.indices)
    if len(ran) < len(items):
        run.subsample = len(ran)
    run.done_s = [0.0] * len(items)
    run.item_batch_s = [0.0] * len(items)
    run.work_lengths = [len(items[i].ids) for i in ran]
    run.work_tokens = sum(run.work_lengths)
    run.aux_lengths = [len(p.aux_ids) for p in items]  # all 0 without TRIAGE_ENCODER
    run.prefix_tokens_recomputed = 0 if run.cached else clf.prefix_length * len(ran)
    return run


def _record(run: ModeRun, b: bucketing.Pass, preds, stats, wall_s: float, cpu_s: float) -> None:
    run.batch_s.append(wall_s)
    run.wall_s += wall_s
    run.cpu_s += cpu_s
    for i, p in zip(b.indices, preds):
        run.preds[i] = p
        run.done_s[i] = run.wall_s
        run.item_batch_s[i] = wall_s
    real, computed = lm_tokens(run, b, stats)  # the LM's (joined features: the encoder's apart)
    run.real_tokens += real
    run.computed_tokens += computed
    run.pass_clocks.append(
        {
            "items": b.size,
            "tokens": computed,
            "wall_ms": wall_s * 1000,
            "host_ms": stats.host_ms,
            "gpu_ms": stats.gpu_ms or None,
        }
    )  # RunStats says 0.0 off CUDA


def _step(clf, items: Sequence, run: ModeRun, b: bucketing.Pass) -> None:
    """One planned pass through ``Classifier.classify``, timed (wall and process CPU)."""
    chunk = [items[i] for i in b.indices]
    local = bucketing.Pass(tuple(range(len(chunk))), b.lengths)
    c0, t0 = time.process_time(), time.perf_counter()
    preds, stats = clf.classify(chunk, [local], prefix_cache=run.cached, pad_to=run.pad_to, attention=run.attention)
    t1, c1 = time.perf_counter(), time.process_time()
    _record(run, b, preds, stats, t1 - t0, c1 - c0)


def _stream(clf, items: Sequence, run: ModeRun, on_batch: Callable[[int], None]) -> None:
    """The whole plan through ``classify_passes`` (the worker's loop).

    A pass's wall time is the time since the previous result (one pass is in flight ahead on CUDA)."""
    by_indices = {b.indices: b for b in run.passes}
    gen = clf.classify_passes(items, run.passes, prefix_cache=run.cached, pad_to=run.pad_to, attention=run.attention)
    c0, t0 = time.process_time(), time.perf_counter()
    for indices, preds, stats in gen:
        t1, c1 = time.perf_counter(), time.process_time()
        _record(run, by_indices[tuple(indices)], preds, stats, t1 - t0, c1 - c0)
        on_batch(len(indices))
        c0, t0 = time.process_time(), time.perf_counter()


def run_sweep(
    clf,
    items: Sequence,
    grid: Sequence[tuple[int, int]],
    interleave: bool = True,
    on_batch: Callable[[int], None] = lambda n: None,
) -> tuple[list[ModeRun], dict | None]:
    """Mode 5 at each (pass_max_items, pass_max_tokens) of ``grid``, planned as the worker plans:
    where throughput saturates. One run per grid point, in grid order; and what the CUDA-graph warm-up
    of their shapes cost (``warm_graphs``; None without graphs)."""
    spec = MODES["bucketed_cached"]
    lengths = [clf.cost_length(p, cached(spec, clf)) for p in items]

    def planned(max_items: int, max_tokens: int) -> list[bucketing.Pass]:
        if clf.attention == "packed":
            return bucketing.plan_packed(lengths, max_items, max_tokens)
        return bucketing.plan_passes(lengths, max_items, max_tokens, clf.options.pass_overhead_tokens)

    runs = [start(clf, items, spec, planned(i, t), None) for i, t in grid]
    warm = warm_graphs(clf, items, [r.passes for r in runs])  # other caps, other shapes: captured before timing
    execute(clf, items, runs, interleave, on_batch)
    return runs, warm


def warm_up(clf, items: Sequence) -> dict | None:
    """A small cached and uncached pass: first-call allocations and kernel selection stay out of the timings;
    then ``warm_graphs`` over mode 5's plan."""
    clf.classify(list(items[:2]), prefix_cache=True)
    clf.classify(list(items[:1]), prefix_cache=False)
    clf.classify(list(items[:1]), prefix_cache=False, attention="padded")
    return warm_graphs(clf, items, [clf.plan(items, cached(MODES["bucketed_cached"], clf))])


def warm_graphs(clf, items: Sequence, plans: Sequence[Sequence[bucketing.Pass]]) -> dict | None:
    """Where packed passes replay CUDA graphs: one pass of every graph shape in ``plans``, before timing.

    A new shape is captured (and checked against an eager run) once per process, which a long-running
    worker pays when a shape comes back and never again. The timed modes then measure the steady state;
    what the captures cost is returned and reported, not hidden. None where no graphs are used.
    """
    if clf.graph_runner() is None:
        return None
    from worker.engine.graph_warmup import capture_plan
    from worker.engine.graphs import shape_for
    from worker.engine.packed import Layout

    carried = 0 if clf.use_prefix_cache else clf.prefix_length  # without the cache each row carries the prefix
    shapes: dict = {}
    for passes in plans:
        for b in passes:
            shapes.setdefault(shape_for(Layout.build([len(items[i].ids) + carried for i in b.indices])), b)
    wall_s = capture_plan(clf, items, list(shapes.values()))  # one pass per shape: captured now, not when it returns
    return {"wall_s": wall_s, "passes": len(shapes), **(clf.graph_stats() or {})}


def mode_keys(spec: str) -> list[str]:
    """``--modes 1,3,5`` -> the modes' keys, in mode order."""
    out = []
    for tok in (t.strip() for t in spec.split(",")):
        if tok and (not tok.isdigit() or not 1 <= int(tok) <= len(MODE_ORDER)):
            raise ValueError(f"--modes takes numbers 1-{len(MODE_ORDER)}, got {tok!r}")
        if tok:
            out.append(MODE_ORDER[int(tok) - 1])
    if not out:
        raise ValueError("--modes selects nothing")
    return sorted(set(out), key=MODE_ORDER.index)
