"""``triage-bench``: every batching mode on the same tickets, same model, same dtype, in one process.

Prints hardware + workload, a progress bar per mode and one table per prompt;
``--json`` writes every figure, ``--plot`` a PNG. Definitions: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

from worker.redact import MaskingArgumentParser, mask_secrets

# CPU defaults, chosen so the default run ends in ~5 min on a shared 2-core CPU (see docs/benchmark.md).
DEFAULT_N, QUICK_N = 24, 4
DEFAULT_FIXED_BATCH, QUICK_FIXED_BATCH = 8, 2
SWEEP_ITEMS, SWEEP_TOKENS = "1,4,16,64", "1024,4096,16384"


def build_parser() -> argparse.ArgumentParser:
    p = MaskingArgumentParser(
        prog="triage-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    w = p.add_argument_group("workload")
    w.add_argument("--n", type=int, help=f"tickets (default {DEFAULT_N}; --quick {QUICK_N})")
    w.add_argument("--seed", type=int, default=0, help="synthetic generator seed / sample seed for --input (default 0)")
    w.add_argument(
        "--input",
        metavar="FILE",
        help="JSON Lines with 'text', or CSV with a 'text' column (a seeded sample of --n rows)",
    )
    w.add_argument(
        "--prompt",
        choices=("few-shot", "zero-shot", "both"),
        default="few-shot",
        help="few-shot = the configured task with its examples (default); zero-shot = the same without examples",
    )
    m = p.add_argument_group("model and batching (defaults: the TRIAGE_* settings)")
    m.add_argument("--model", help="TRIAGE_MODEL: HF id, directory, .gguf or bundled:smollm2")
    m.add_argument("--model-label", help="name shown in the table/plot instead of --model (e.g. for a temp directory)")
    m.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"))
    m.add_argument("--dtype", choices=("auto", "fp16", "bf16", "fp32"))
    m.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (TRIAGE_TORCH_THREADS; default: the worker's "
        "'auto' rule, 1 on hosts with <= 4 CPUs; 0 = torch's default; see docs/benchmark.md)",
    )
    m.add_argument(
        "--pass-max-items",
        "--max-batch-items",
        dest="pass_max_items",
        type=int,
        help="modes 4-6: items per pass at most (TRIAGE_PASS_MAX_ITEMS)",
    )
    m.add_argument(
        "--pass-max-tokens",
        "--max-batch-tokens",
        dest="pass_max_tokens",
        type=int,
        help="modes 4-6: padded tokens per pass at most (TRIAGE_PASS_MAX_TOKENS)",
    )
    m.add_argument(
        "--attention",
        choices=("auto", "padded", "packed"),
        help="TRIAGE_ATTENTION for mode 5 and 6 (auto: packed on CUDA, padded on CPU); modes 1-4 always run padded",
    )
    m.add_argument(
        "--fixed-batch",
        type=int,
        help=f"modes 2-3: items per arrival-order batch (default {DEFAULT_FIXED_BATCH}; --quick {QUICK_FIXED_BATCH})",
    )
    r = p.add_argument_group("what to run")
    r.add_argument("--modes", default="1,2,3,4,5", help="comma list of modes 1-5 (default all; ratios need 1)")
    r.add_argument(
        "--no-interleave",
        action="store_true",
        help="run modes one after another, each through classify_passes as the worker does "
        "(default on CUDA; "
        "on CPU the default interleaves them pass by pass)",
    )
    r.add_argument(
        "--sequential-n",
        type=int,
        metavar="N",
        help="mode 1 on the first N tickets only (a large workload; ratios are per-ticket rates)",
    )
    r.add_argument(
        "--baseline-n",
        type=int,
        metavar="N",
        help="modes 2-4 on the first N tickets only (mode 5 always runs all of them)",
    )
    r.add_argument("--quick", action="store_true", help=f"{QUICK_N} tickets: a smoke run, well under a minute")
    r.add_argument("--sweep", action="store_true", help="also run mode 5 over a pass_max_items x pass_max_tokens grid")
    r.add_argument("--sweep-items", default=SWEEP_ITEMS, help="grid for --sweep (default %(default)s)")
    r.add_argument("--sweep-tokens", default=SWEEP_TOKENS, help="grid for --sweep (default %(default)s)")
    r.add_argument(
        "--backbones",
        metavar="SPECS",
        help="also compare backbones on the same tickets, each with the worker's scorer for it: comma list of "
        "MODEL or LM+ENCODER, e.g. bundled:smollm2,bundled:minilm,bundled:smollm2+bundled:minilm",
    )
    r.add_argument(
        "--redis", action="store_true", help="mode 6: the same tickets through Redis + `python -m worker run --drain`"
    )
    r.add_argument("--redis-url", help="TRIAGE_REDIS_URL for --redis")
    r.add_argument("--gemm-tokens", type=int, help="M of the GEMM microbenchmark (default 512 on CPU, 8192 on GPU)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", help="write every figure as JSON (keys: docs/benchmark.md)")
    o.add_argument("--plot", metavar="OUT_PNG", help="throughput, padding and length-histogram figure")
    o.add_argument(
        "--profile",
        metavar="OUT_TXT",
        help="after the timed runs, mode 5's passes (first prompt) once more under torch.profiler: op tables "
        "by device and host time, launches per pass (not timings)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    from worker.redact import install_excepthook, register_env_secrets

    install_excepthook()  # as the worker's CLI: every output masks the Redis URL's secrets, not only URL shapes
    register_env_secrets()
    args = build_parser().parse_args(argv)  # registers the secrets of URLs given as flags
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):  # tokenize threads: the worker's setting
        os.environ.setdefault(k, v)
    try:
        from worker.bench.modes import mode_keys

        modes = mode_keys(args.modes)
        sweep = [(i, t) for i in _ints(args.sweep_items) for t in _ints(args.sweep_tokens)] if args.sweep else []
    except ValueError as e:
        print(f"triage-bench: {e}", file=sys.stderr)
        return 2
    n = args.n if args.n is not None else (QUICK_N if args.quick else DEFAULT_N)
    if args.fixed_batch is None:
        args.fixed_batch = QUICK_FIXED_BATCH if args.quick else DEFAULT_FIXED_BATCH
    args.argv = [mask_secrets(a) for a in (sys.argv[1:] if argv is None else argv)]  # the JSON keeps it: no password
    if (
        n < 1
        or args.fixed_batch < 1
        or (args.threads is not None and args.threads < 0)
        or any(x is not None and x < 1 for x in (args.sequential_n, args.baseline_n))
    ):
        print(
            "triage-bench: --n, --fixed-batch, --sequential-n and --baseline-n must be >= 1, --threads >= 0",
            file=sys.stderr,
        )
        return 2
    return run_benchmark(args, n, modes, sweep)


def run_benchmark(args: argparse.Namespace, n: int, modes: list[str], sweep: list[tuple[int, int]]) -> int:
    settings = bench_settings(args)
    import torch

    default_threads = torch.get_num_threads()
    try:
        return _run(args, settings, n, modes, sweep, default_threads)
    finally:
        torch.set_num_threads(default_threads)  # leave in-process callers (tests) as they were


def bench_settings(args: argparse.Namespace):
    """The worker's settings (``TRIAGE_*``) with the bench's flags applied: every mode, the Redis one too, runs these.

    ``--threads`` becomes ``torch_threads``; without it the worker's own setting (default "auto") applies.
    Invalid settings, a task, model, head or scorer the worker could not start with: one line each and exit 2,
    as for the worker (``preflight``), before anything loads.
    """
    from worker import preflight

    names = ("model", "device", "dtype", "pass_max_items", "pass_max_tokens", "redis_url", "attention")
    overrides = {k: getattr(args, k, None) for k in names} | {"torch_threads": getattr(args, "threads", None)}
    settings = preflight.settings_or_exit(
        "triage-bench", check_redis_url=bool(getattr(args, "redis", False)), **overrides
    )
    model_var = "--model" if overrides["model"] is not None else "TRIAGE_MODEL"
    preflight.exit_on("triage-bench", preflight.classifier_problems(settings, names={"model": model_var}))
    return settings


def _run(
    args: argparse.Namespace, settings, n: int, modes: list[str], sweep: list[tuple[int, int]], default_threads: int
) -> int:
    from worker.assemble import task_from_settings
    from worker.bench import report
    from worker.bench import workload as wl
    from worker.bench.encoder_tokens import joined_note
    from worker.bench.gemm import ModelShape, measure_gemm
    from worker.bench.hardware import hardware
    from worker.bench.modes import MODE_ORDER, MODES, run_modes, run_sweep, warm_up
    from worker.bench.notes import captures_note, prompt_note, ratio_note, unforeseen

    t_start = time.perf_counter()
    wk = wl.from_file(args.input, n, args.seed) if args.input else wl.synthetic(n, args.seed)
    clfs = build_classifiers(settings, wl.prompt_tasks(task_from_settings(settings), args.prompt))
    first = clfs[0][1]
    requested = wk.n
    # the tokenizer is shared: one tokenization describes the workload (less what the worker would dead-letter)
    wk, items, dropped = wl.without_invalid(wk, first)
    if not wk.texts:
        why = "; ".join(f"{k} x{v}" for k, v in dropped.items())
        print(f"triage-bench: all {requested} tickets would be dead-lettered ({why}): nothing to time", file=sys.stderr)
        return 2
    shape = ModelShape.from_model(first.model, causal=first.kind != "encoder")
    enc_shape = ModelShape.from_model(first.encoder.model, causal=False) if first.encoder is not None else None
    gemm = measure_gemm(
        shape, first.device, first.model.dtype, args.gemm_tokens or (8192 if first.device.type == "cuda" else 512)
    )
    doc = {
        "schema": report.SCHEMA,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": args.argv,
        "quick": args.quick,
        "hardware": {**hardware(first), "torch_default_threads": default_threads},
        "model": {
            "name": settings.model,
            "label": args.model_label,
            "shape": shape.as_dict(),
            "encoder_shape": enc_shape.as_dict() if enc_shape else None,  # TRIAGE_ENCODER (joined features)
            "labels": list(first.labels),
        },
        "settings": report.run_settings(
            settings, first, fixed_batch=args.fixed_batch, sequential_n=args.sequential_n, baseline_n=args.baseline_n
        ),
        "workload": {
            "source": wk.source,
            "n": wk.n,
            "seed": args.seed,
            "words": wl.length_summary([len(t.split()) for t in wk.texts]),
            "text_tokens": wl.length_summary([p.n_text_tokens for p in items]),
            "truncated": sum(p.truncated for p in items),
            "dropped": requested - wk.n,  # refused before any mode ran (TRIAGE_TRUNCATE=false: over the limit)
            "dropped_reasons": dropped,
        },
        "gemm": gemm.as_dict(),
        "runs": [],
        "redis": None,
    }
    print(report.header(doc["hardware"], doc["model"], doc["workload"], doc["gemm"], doc["settings"]), flush=True)
    cpu_clock = first.device.type == "cpu"  # CPU-time figures: only where the model runs on the CPU
    interleave = not args.no_interleave and first.device.type != "cuda"  # a dedicated GPU needs no interleaving
    first_runs: dict = {}
    for prompt, clf in clfs:
        items = clf.prepare_valid(list(wk.texts))
        warm = warm_up(clf, items)
        if warm:
            print(f"[{prompt}] {captures_note(warm)} before timing (once per process; not in the timings)", flush=True)
        with _bar(
            args, len(items) * len(modes), f"{prompt}: modes {','.join(str(MODE_ORDER.index(k) + 1) for k in modes)}"
        ) as bar:
            runs = run_modes(
                clf,
                items,
                [MODES[k] for k in modes],
                args.fixed_batch,
                interleave,
                bar.update,
                args.sequential_n,
                args.baseline_n,
            )
        for key in modes:
            done = sum(p is not None for p in runs[key].preds)
            print(
                f"  {prompt} {runs[key].title}: {done} tickets, {runs[key].wall_s:.1f}s wall, "
                f"{runs[key].cpu_s:.1f}s CPU",
                file=sys.stderr,
                flush=True,
            )
        base = runs.get("sequential")
        first_runs = first_runs or {
            k: runs[k] for k in ("sequential", "bucketed_cached") if k in runs and prompt == "few-shot"
        }
        summaries = [
            report.summarize(runs[k], shape, clf.prefix_length, doc["gemm"], base, cpu_clock, enc_shape) for k in modes
        ]
        entry = {
            "prompt": prompt,
            "prefix_tokens": clf.prefix_length,
            "baseline": "sequential" if base else None,
            "modes": summaries,
            "suffix_tokens": [len(p.ids) for p in items],
            "buckets": None,
            "sweep": [],
        }
        if "bucketed_cached" in runs:
            entry["buckets"] = [
                {"items": b.size, "min_len": min(b.lengths), "max_len": b.max_len}
                for b in runs["bucketed_cached"].passes
            ]
        print(
            f"\n[{prompt}{prompt_note(clf)}] prompt prefix {clf.prefix_length} tokens; {ratio_note(runs, len(items))}\n"
            + report.table(summaries)
            + ("\n" + note if (note := joined_note(summaries)) else ""),
            flush=True,
        )
        unforeseen(prompt, "modes", warm, timed := clf.graph_stats())
        if sweep:
            with _bar(args, len(items) * len(sweep), f"sweep: {len(sweep)} settings") as bar:
                sweep_runs, sweep_warm = run_sweep(clf, items, sweep, interleave, bar.update)
            if sweep_warm:
                print(f"[{prompt}] sweep: {captures_note(sweep_warm, since=timed)} before timing", flush=True)
            entry["sweep"] = report.sweep_rows(sweep, sweep_runs, shape, clf.prefix_length, doc["gemm"], cpu_clock)
            print("\n[" + prompt + "] sweep (mode 5)\n" + report.sweep_table(entry["sweep"]), flush=True)
            unforeseen(prompt, "sweep", sweep_warm, clf.graph_stats())
            entry["cuda_graphs_sweep_warm_up"] = sweep_warm
        entry["cuda_graphs_warm_up"] = warm  # captures before timing (None: no CUDA graphs)
        entry["cuda_graphs"] = timed  # totals after the modes (warm-up included)
        doc["runs"].append(entry)
        if args.json:  # as it goes: a run cut short by a time limit still leaves every finished prompt
            report.write_json(args.json, {**doc, "complete": False, "total_s": time.perf_counter() - t_start})
        if getattr(args, "profile", None) and "bucketed_cached" in runs and len(doc["runs"]) == 1:
            from worker.bench.profile import profile_passes

            entry["profile"] = profile_passes(clf, items, runs["bucketed_cached"].passes, args.profile)
    if getattr(args, "backbones", None):
        from worker.bench import backbones as bb

        specs = [x.strip() for x in args.backbones.split(",") if x.strip()]
        with _bar(args, len(wk.texts) * len(specs), f"backbones: {len(specs)}, interleaved") as bar:
            doc["backbones"] = bb.run_backbones(settings, specs, wk.texts, bar.update)
        title = "\nbackbones (the worker's path and scorer for each; passes interleaved)\n"
        print(title + bb.table(doc["backbones"]), flush=True)
    if args.redis:
        from worker.bench.redis_mode import mode6

        print("\nmode 6: enqueue + `python -m worker run --drain` (few-shot task) ...", flush=True)
        doc["redis"] = mode6(settings, wk.texts, first.dtype_name, first_runs, doc["runs"], first.use_prefix_cache)
        print(report.redis_line(doc["redis"]), flush=True)
    doc["total_s"] = time.perf_counter() - t_start
    doc["complete"] = True
    if args.json:
        report.write_json(args.json, doc)
        print(f"\nJSON: {args.json}")
    if args.plot:
        try:
            from worker.bench.plot import plot

            plot(doc, args.plot)
            print(f"plot: {args.plot}")
        except ImportError as e:  # matplotlib is optional (the GPU box may lack it)
            print(
                f"plot skipped ({e}); re-plot later: "
                f"python -m worker.bench.plot {args.json or 'BENCH.json'} {args.plot}"
            )
    print(f"total {doc['total_s']:.0f}s (model load, GEMM, all modes)")
    return 1 if (doc.get("redis") or {}).get("error") else 0  # mode 6 asked for and not measured


def build_classifiers(settings, tasks) -> list[tuple[str, object]]:
    """One classifier per prompt variant, each built as the worker builds its own: the first loads the backbones
    as the worker does (with an encoder and TRIAGE_DTYPE=auto, both in one dtype: ``assemble.backbones``, a rule a
    model passed in turns off), the others share them."""
    from worker.assemble import build_classifier

    out: list[tuple[str, object]] = []
    for name, task in tasks:
        first = out[0][1] if out else None
        shared = {"loaded": first.loaded, "encoder": first.encoder} if first is not None else {}
        out.append((name, build_classifier(settings, task=task, **shared)))
    return out


def _bar(args, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc[:48], unit="tk", file=sys.stderr, leave=False, disable=True if args.no_progress else None
    )


def _ints(spec: str) -> list[int]:
    vals = [int(x) for x in spec.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"expected a comma list of positive integers, got {spec!r}")
    return vals


if __name__ == "__main__":
    sys.exit(main())
