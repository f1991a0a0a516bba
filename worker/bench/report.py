"""Turn mode runs into figures: one dict per mode (the JSON), and a terminal table.

All ratios are against the sequential mode of the same run, so noise from a
shared machine mostly cancels.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path

from worker.bench.encoder_tokens import encoder_figures, lm_passes
from worker.bench.gemm import ModelShape, computed_flops, work_flops
from worker.engine.types import padding_pct, percentile

SCHEMA = "triage-bench/2"  # 2: batch -> pass / window key names (pass_max_items, passes, worker_windows)


def agreement(preds: Sequence, base: Sequence | None) -> tuple[float | None, float | None]:
    """Share of tickets with the baseline's label, and the largest |probability difference| on any label.

    Over the tickets both ran (the baseline may have run a subsample).
    """
    if base is None:
        return None, None
    pairs = [(p, b) for p, b in zip(preds, base) if p is not None and b is not None]
    if not pairs:
        return None, None
    same = sum(p.label == b.label for p, b in pairs)
    delta = max((abs(p.scores[k] - b.scores[k]) for p, b in pairs for k in b.scores), default=0.0)
    return same / len(pairs), delta


def summarize(
    run,
    shape: ModelShape,
    prefix_len: int,
    gemm: dict | None,
    base=None,
    cpu_clock: bool = True,
    encoder_shape: ModelShape | None = None,
) -> dict:
    """Every figure for one mode. ``base``: the sequential run (ratios, agreement); ``gemm``: ``GemmResult.as_dict()``.

    ``cpu_clock``: also report CPU-time figures (process CPU seconds, all threads). On a
    shared CPU they measure the work done rather than the time spent waiting for a core;
    on a GPU they mean nothing and are left out. Tokens and FLOPs are the LM's; a joined
    encoder's (``encoder_shape``) are under ``encoder``.
    """
    ran = [i for i, p in enumerate(run.preds) if p is not None]
    n = len(ran)
    work_fl = work_flops(shape, prefix_len, run.work_lengths)
    packed = run.attention == "packed"
    extra = run.computed_tokens - run.real_tokens if packed else 0  # a CUDA graph shape's rounding
    comp_fl = computed_flops(shape, lm_passes(run), prefix_len, run.cached, run.pad_to, packed, extra)
    agree, dprob = agreement(run.preds, None if base is None else base.preds)
    wall, cpu = run.wall_s, (run.cpu_s if cpu_clock else None)
    peak, peak_cpu = (gemm or {}).get("flops_per_s"), (gemm or {}).get("flops_per_cpu_s") if cpu_clock else None
    t = {
        "computed": run.computed_tokens,
        "real": run.real_tokens,
        "work": run.work_tokens,
        "padding": run.computed_tokens - run.real_tokens,
        "prefix_recomputed": run.prefix_tokens_recomputed,
        "text": sum(run.preds[i].n_tokens for i in ran),
    }
    return {
        "key": run.key,
        "title": run.title,
        "prefix_cache": run.cached,
        "pad_to": run.pad_to,
        "items": n,
        "subsample": run.subsample,
        "attention": run.attention,
        "passes": len(run.passes),
        "wall_s": wall,
        "cpu_s": cpu,
        "items_per_s": _div(n, wall),
        "items_per_cpu_s": _div(n, cpu),
        "work_tokens_per_s": _div(run.work_tokens, wall),
        "tokens": t,
        "padding_pct": padding_pct(t["real"], t["computed"]) if t["computed"] else None,
        "padding_waste_x": _div(t["computed"], t["real"]),
        "computed_per_work_x": _div(t["computed"], t["work"]),
        # per-ticket rates: the sequential baseline may have run a subsample
        "speedup_vs_sequential": _div(_div(n, wall), _rate(base, "wall_s")) if base is not None else None,
        "speedup_vs_sequential_cpu": _div(_div(n, cpu), _rate(base, "cpu_s")) if base is not None and cpu else None,
        "label_agreement": agree,
        "max_abs_dprob": dprob,
        "latency": {
            "batch_ms_p50": _ms(percentile([run.item_batch_s[i] for i in ran], 50, nearest=True)),
            "batch_ms_p99": _ms(percentile([run.item_batch_s[i] for i in ran], 99, nearest=True)),
            "done_s_p50": percentile([run.done_s[i] for i in ran], 50, nearest=True),
            "done_s_p99": percentile([run.done_s[i] for i in ran], 99, nearest=True),
        },
        "clocks": clocks(run),
        "flops": {
            "work": work_fl,
            "computed": comp_fl,
            "work_per_s": _div(work_fl, wall),
            "computed_per_s": _div(comp_fl, wall),
            "mfu": _div(_div(work_fl, wall), peak),
            "hfu": _div(_div(comp_fl, wall), peak),
            "mfu_cpu": _div(_div(work_fl, cpu), peak_cpu),
        },
        "encoder": encoder_figures(run, encoder_shape, wall),  # None without TRIAGE_ENCODER
    }


def sweep_rows(
    grid: Sequence[tuple[int, int]],
    runs: Sequence,
    shape: ModelShape,
    prefix_len: int,
    gemm: dict | None,
    cpu_clock: bool,
) -> list[dict]:
    """One row per sweep point (``modes.run_sweep``'s runs, in grid order): the figures the sweep table shows."""
    rows = []
    for (max_items, max_tokens), run in zip(grid, runs):
        s = summarize(run, shape, prefix_len, gemm, cpu_clock=cpu_clock)
        rows.append(
            {
                "pass_max_items": max_items,
                "pass_max_tokens": max_tokens,
                "passes": s["passes"],
                "wall_s": s["wall_s"],
                "cpu_s": s["cpu_s"],
                "items_per_s": s["items_per_s"],
                "items_per_cpu_s": s["items_per_cpu_s"],
                "padding_pct": s["padding_pct"],
                "mfu": s["flops"]["mfu"],
                "mfu_cpu": s["flops"]["mfu_cpu"],
            }
        )
    return rows


def clocks(run) -> dict:
    """Per pass and summed: host wall (perf_counter), host work (launch + postprocess) and device time (CUDA events).

    ``gpu_busy_pct`` = device time / wall time: how much of the mode the GPU was computing.
    On the CPU ``gpu_ms`` is None.
    """
    gpu = [c["gpu_ms"] for c in run.pass_clocks if c.get("gpu_ms") is not None]
    host = sum(c["host_ms"] for c in run.pass_clocks)
    gpu_s = sum(gpu) / 1000.0 if gpu else None
    return {
        "wall_s": run.wall_s,
        "host_s": host / 1000.0,
        "gpu_s": gpu_s,
        "gpu_busy_pct": _div(100.0 * gpu_s, run.wall_s) if gpu_s is not None else None,
        "passes": run.pass_clocks,
    }


def _rate(run, clock: str) -> float | None:
    return _div(sum(p is not None for p in run.preds), getattr(run, clock))


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


# ------------------------------------------------------------------- tables
_SPEED = [
    ("mode", 31, lambda m: m["title"]),
    ("items/s", 7, lambda m: _f(m["items_per_s"], 2)),
    ("x seq", 5, lambda m: _f(m["speedup_vs_sequential"], 2)),
    ("tok/s", 6, lambda m: _f(m["work_tokens_per_s"], 0)),
    ("MFU %", 5, lambda m: _f(_pct(m["flops"]["mfu"]), 1)),
    ("GPU busy %", 10, lambda m: _f((m.get("clocks") or {}).get("gpu_busy_pct"), 1)),
    ("CPU s", 6, lambda m: _f(m["cpu_s"], 1)),
    ("x seq CPU", 9, lambda m: _f(m["speedup_vs_sequential_cpu"], 2)),
    ("MFU CPU %", 9, lambda m: _f(_pct(m["flops"]["mfu_cpu"]), 1)),
    ("batch ms p50/p99", 16, lambda m: f"{_f(m['latency']['batch_ms_p50'], 0)}/{_f(m['latency']['batch_ms_p99'], 0)}"),
    ("done s p50/p99", 14, lambda m: f"{_f(m['latency']['done_s_p50'], 1)}/{_f(m['latency']['done_s_p99'], 1)}"),
]
_WORK = [
    ("mode", 31, lambda m: m["title"]),
    ("passes", 7, lambda m: str(m["passes"])),
    ("computed", 8, lambda m: str(m["tokens"]["computed"])),
    ("real", 6, lambda m: str(m["tokens"]["real"])),
    ("ticket", 6, lambda m: str(m["tokens"]["work"])),
    ("pad %", 5, lambda m: _f(m["padding_pct"], 1)),
    ("pad x", 5, lambda m: _f(m["padding_waste_x"], 2)),
    ("comp/ticket", 11, lambda m: _f(m["computed_per_work_x"], 2)),
    ("items", 6, lambda m: str(m["items"])),
    ("agree %", 7, lambda m: _f(_pct(m["label_agreement"]), 1)),
    ("max|dp|", 7, lambda m: _f(m["max_abs_dprob"], 4)),
]


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _table(cols, modes: Sequence[dict]) -> str:
    head = "  ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w, _) in enumerate(cols))
    lines = [head, "-" * len(head)]
    for m in modes:
        lines.append("  ".join(fn(m).rjust(w) if i else fn(m)[:w].ljust(w) for i, (_, w, fn) in enumerate(cols)))
    return "\n".join(lines)


def table(modes: Sequence[dict]) -> str:
    """Speed (wall clock and CPU time) and work (tokens, padding, answers); columns in docs/benchmark.md."""
    return _table(_SPEED, modes) + "\n\n" + _table(_WORK, modes)


def sweep_table(rows: Sequence[dict]) -> str:
    lines = ["pass_max_items  pass_max_tokens   passes  items/s  items/CPU-s  pad %  MFU %", "-" * 76]
    for r in rows:
        lines.append(
            f"{r['pass_max_items']:>14}  {r['pass_max_tokens']:>15}  {r['passes']:>7}  {_f(r['items_per_s'], 2):>7}"
            f"  {_f(r['items_per_cpu_s'], 2):>11}  {_f(r['padding_pct'], 1):>5}  {_f(_pct(r['mfu']), 1):>5}"
        )
    return "\n".join(lines)


def header(hardware: dict, model: dict, workload: dict, gemm: dict | None, settings: dict) -> str:
    hw = hardware
    lines = [
        f"hardware : {hw['cpu_model']} | {hw['cpu_cores']} cores | "
        f"torch threads {hw['torch_threads']}{_threads_note(hw)} | "
        f"tokenize threads {hw.get('tokenize_threads', '?')} | "
        f"device {hw['device']}{' (' + hw['device_name'] + ')' if hw.get('device_name') else ''} | "
        f"dtype {hw['dtype']} | "
        f"torch {hw['torch']} | transformers {hw['transformers']}",
        f"model    : {model.get('label') or model['name']} | {model['shape']['layers']} layers, "
        f"hidden {model['shape']['hidden']}, "
        f"{model['shape']['non_embedding_params'] / 1e6:.1f}M non-embedding params",
        f"workload : {workload['source']} | {workload['n']} tickets | "
        f"text tokens p50 {workload['text_tokens'].get('p50')} "
        f"p90 {workload['text_tokens'].get('p90')} p99 {workload['text_tokens'].get('p99')} "
        f"max {workload['text_tokens'].get('max')} "
        f"(truncated at {settings['max_input_tokens']}: {workload['truncated']}){_dropped(workload)}",
        f"passes   : pass_max_items {settings['pass_max_items']}, pass_max_tokens {settings['pass_max_tokens']}, "
        f"overhead {settings['pass_overhead_tokens']} tokens{_measured(settings)} "
        f"(modes 4-6; mode 6 windows of {_windows(settings)}); "
        f"fixed batch {settings['fixed_batch_items']} items (modes 2-3); scorer {settings['scorer']}",
    ]
    if settings.get("attention"):
        lines.append(
            f"engine   : mode 5 attention {settings['attention']} (kernel {settings.get('attention_kernel')}, "
            f"CUDA graphs "
            f"{'on' if settings.get('cuda_graphs') else 'off'}), "
            f"prefix cache {_cache_state(settings)}, "
            f"caps {settings.get('engine_pass_max_items')} items / "
            f"{settings.get('engine_pass_max_tokens')} tokens; modes 1-4 padded"
            + (f"; mode 1 on the first {settings['sequential_n']} tickets" if settings.get("sequential_n") else "")
            + (f"; modes 2-4 on the first {settings['baseline_n']}" if settings.get("baseline_n") else "")
        )
    if gemm:
        per_cpu = f", {gemm['flops_per_cpu_s'] / 1e9:,.1f} GFLOP per CPU-second" if hw["device"] == "cpu" else ""
        lines.append(
            f"GEMM     : {gemm['flops_per_s'] / 1e9:,.1f} GFLOP/s measured{per_cpu} "
            f"({gemm['dtype']}, M={gemm['tokens']}, "
            f"the model's 7 linear shapes, best of 5)"
        )
    if hw.get("load_avg_1m") is not None:
        lines.append(
            f"load     : 1-min load average {hw['load_avg_1m']} at start (other processes share this machine: "
            "compare the CPU-time columns)"
            if hw["device"] == "cpu"
            else f"load     : {hw['load_avg_1m']}"
        )
    return "\n".join(lines)


def _dropped(workload: dict) -> str:
    """The tickets left out of every mode, and why (``workload.without_invalid``); "" when none were."""
    if not workload.get("dropped"):
        return ""
    why = "; ".join(f"{k} x{v}" for k, v in (workload.get("dropped_reasons") or {}).items())
    return (
        f"\n           {workload['dropped']} more tickets dropped from every mode, "
        f"as the worker would dead-letter them: {why}"
    )


def _threads_note(hw: dict) -> str:
    default = hw.get("torch_default_threads")
    if hw["device"] != "cpu" or default is None or default == hw["torch_threads"]:
        return ""
    return f" (TRIAGE_TORCH_THREADS / --threads, as the worker; torch's default is {default})"


def _windows(settings: dict) -> str:
    """Mode 6's window size in words: fixed, or sized by measured work (TRIAGE_WINDOW_TARGET_S)."""
    target = settings.get("window_target_s") or 0
    cap = settings["window_max_items"]
    return f"up to {cap}, sized to {target:g} s of work" if target else str(cap)


def _cache_state(settings: dict) -> str:
    """The prefix cache as the classifier runs it (a model whose fast paths refuse it runs without, as mode 5)."""
    if settings.get("prefix_cache", True):
        return "on"
    asked = settings.get("prefix_cache_setting") is not False  # TRIAGE_PREFIX_CACHE on: the model refuses it
    return "off (not for this model)" if asked else "off (TRIAGE_PREFIX_CACHE=false)"


def _measured(settings: dict) -> str:
    """ " (measured)" when TRIAGE_PASS_OVERHEAD_TOKENS=auto timed this run's passes (CUDA's default is not measured)."""
    return " (measured)" if settings.get("pass_overhead_measured") else ""


def run_settings(
    settings, clf, *, fixed_batch: int, sequential_n: int | None = None, baseline_n: int | None = None
) -> dict:
    """The batching settings every mode ran with (the JSON's ``settings``): what the classifier plans and runs with
    on this device (on CUDA the engine's pass caps where TRIAGE_PASS_* are unset), not only what was asked."""
    from worker.assemble import window_max_items
    from worker.engine.overhead import measured_here

    return {
        "pass_max_items": clf.options.pass_max_items,  # modes 4-6 plan with these (CUDA: 2048 / 32768 where unset)
        "pass_max_tokens": clf.options.pass_max_tokens,
        "pass_overhead_tokens": clf.options.pass_overhead_tokens,  # what the planner used ("auto": measured)
        "pass_overhead_measured": measured_here(settings.pass_overhead_tokens, clf.device),
        "window_max_items": window_max_items(settings, clf.device),  # mode 6's: the CUDA default where unset
        "window_target_s": settings.window_target_s,
        "fixed_batch_items": fixed_batch,
        "max_input_tokens": settings.max_input_tokens,
        "truncate": settings.truncate,  # false: tickets over max_input_tokens are dropped (workload.dropped)
        "scorer": clf.scorer.kind,
        "prefix_cache": clf.use_prefix_cache,  # what mode 5 runs: off where the model's fast paths refuse it
        "prefix_cache_setting": settings.prefix_cache,  # TRIAGE_PREFIX_CACHE
        "attention": clf.attention,
        "attention_kernel": clf.attention_kernel,
        "cuda_graphs": bool(clf.options.cuda_graphs and clf.device.type == "cuda" and clf.attention == "packed"),
        "engine_pass_max_items": clf.options.pass_max_items,
        "engine_pass_max_tokens": clf.options.pass_max_tokens,
        "sequential_n": sequential_n,
        "baseline_n": baseline_n,
    }


def write_json(path: str | Path, doc: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _ramp(sizes: list[int] | None) -> str:
    """Window sizes in order, runs of one size folded: ``256, 512, 4096 x2, 1888``."""
    runs = [(n, len(list(g))) for n, g in groupby(sizes or [])]
    return ", ".join(f"{n} x{k}" if k > 1 else str(n) for n, k in runs) or "?"


def redis_line(red: dict) -> str:
    """Mode 6 in a few lines: throughput through the queue, and where its time went."""
    if red.get("error"):
        return f"6 through Redis: FAILED: {red['error']}"
    agree = ", ".join(
        f"{_f(_pct(a['label_agreement']), 1)}% labels as {k} (max|dp| {a['max_abs_dprob']:.4f})"
        for k, a in red.get("agreement", {}).items()
    )
    return (
        f"6 through Redis + worker: {red['items']} tickets, {_f(red['items_per_s'], 2)} items/s "
        f"({_f(red.get('vs_mode5'), 2)}x mode 5, measured at another time) "
        f"over {red['wall_s']:.1f}s from worker_ready to the "
        f"last result, {_f(red.get('queue_overhead_pct'), 1)}% of it outside the forward passes"
        + (f", the device busy {_f(red['gpu_busy_pct'], 1)}% of it" if red.get("gpu_busy_pct") is not None else "")
        + "; "
        f"{red['worker_windows']} worker windows ({_ramp(red.get('window_items'))} tickets, "
        f"{red.get('windows_first_pass_early', '?')} with the first pass queued early): "
        f"infer {red['infer_s']:.1f}s, tokenize {red['tokenize_s']:.2f}s, "
        f"read {red['read_s']:.2f}s, write {red['write_s']:.2f}s (first window read + tokenized in "
        f"{_f(red.get('first_window_s'), 2)}s, first result after {_f(red.get('first_result_s'), 2)}s); "
        f"enqueue {red['enqueue_s']:.2f}s; "
        f"process {red['process_s']:.1f}s incl. model load; replies parsed by {red.get('redis_parser') or '?'}; "
        f"pass overhead {red.get('pass_overhead_tokens', '?')} tokens (the worker's own)"
        + (
            f"; {red['cuda_graph_captures']} CUDA graph captures after worker_ready took "
            f"{red['cuda_graph_capture_s']:.2f}s of its wall time (once per process; "
            f"{_f(red.get('items_per_s_without_captures'), 2)} items/s without them)"
            if red.get("cuda_graph_captures")
            else ""
        )
        + (
            f"; {up['captures']} full-pass shapes captured at its start-up in {up['wall_s']:.2f}s (before worker_ready)"
            if (up := red.get("cuda_graphs_start_up"))
            else ""
        )
        + f"\n  {agree or 'no reference run (needs the few-shot prompt)'}"
    )
