"""One PNG from a benchmark document: throughput by mode, where the tokens went, ticket lengths vs buckets.

Reads only the JSON-shaped dict, so a saved ``--json`` file can be re-plotted.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"work": "#2b7bba", "prefix": "#f0a030", "padding": "#d04040"}


def plot(doc: dict, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    sweep = next((r for r in runs if r.get("sweep")), None)
    fig = plt.figure(figsize=(17, 9.5), constrained_layout=True)
    grid = fig.add_gridspec(2, 3)
    _throughput(fig.add_subplot(grid[0, 0]), runs, doc.get("redis"))
    _tokens(fig.add_subplot(grid[0, 1]), runs)
    _mfu(fig.add_subplot(grid[0, 2]), runs, doc)
    _histogram(fig.add_subplot(grid[1, :2] if sweep else grid[1, :]), runs[0], doc)
    if sweep:
        _sweep(fig.add_subplot(grid[1, 2]), sweep)
    hw, wk = doc["hardware"], doc["workload"]
    threads = f"{hw['torch_threads']} torch thread" + ("s" if hw["torch_threads"] != 1 else "")
    dev = hw.get("device_name") or f"{hw['cpu_model']} CPU, {hw['cpu_cores']} cores, {threads}"
    model = doc["model"].get("label") or doc["model"]["name"]
    fig.suptitle(
        f"triage-bench: {model}, {hw['dtype']}, on {dev}  |  the same {wk['n']} tickets in every mode ({wk['source']})",
        fontsize=12,
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _mfu(ax, runs, doc) -> None:
    """Useful model FLOP/s (and all computed FLOP/s) as a share of the GEMM measured in the same run."""
    modes = runs[0]["modes"]
    xs = range(len(modes))
    cpu = modes[0]["flops"].get("mfu_cpu") is not None
    bars = [("hfu", "all computed FLOPs (HFU, wall)", "#bbbbbb"), ("mfu", "useful FLOPs (MFU, wall)", COLORS["work"])]
    if cpu:
        bars.append(("mfu_cpu", "useful FLOPs per CPU-second (MFU, CPU time)", "#50a050"))
    w = 0.8 / len(bars)
    for j, (key, label, color) in enumerate(bars):
        pos = [x + (j - (len(bars) - 1) / 2) * w for x in xs]
        vals = [100 * (m["flops"].get(key) or 0) for m in modes]
        ax.bar(pos, vals, w, color=color, label=label)
        if key != "hfu":
            for x, v in zip(pos, vals):
                ax.annotate(f"{v:.0f}%", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [_short(m["title"]) for m in modes], fontsize=8)
    g = doc["gemm"]
    ax.set_ylabel(f"% of the GEMM measured in this run ({g['flops_per_s'] / 1e9:,.4g} GFLOP/s {g['dtype']})")
    ax.margins(y=0.15)
    ax.set_title(f"Distance to the limit ({runs[0]['prompt']})")
    ax.legend(fontsize=8)


def _short(title: str) -> str:
    """'5 length buckets + prefix cache' -> '5 buckets+cache' style labels that fit under a bar."""
    return {
        "1": "1 sequential",
        "2": "2 pad global",
        "3": "3 arrival",
        "4": "4 buckets",
        "5": "5 buckets\ncache off" if "cache off" in title else "5 buckets\n+cache",
        "6": "6 redis\nworker",
    }.get(title.split()[0], title)


def _throughput(ax, runs, redis) -> None:
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        modes = run["modes"]
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(modes))]
        vals = [m["items_per_s"] or 0 for m in modes]
        bars = ax.bar(xs, vals, width, label=f"{run['prompt']} (prefix {run['prefix_tokens']} tok)")
        for b, m in zip(bars, modes):
            x, xc = m.get("speedup_vs_sequential"), m.get("speedup_vs_sequential_cpu")
            if x is not None:
                text = f"{x:.1f}x" + (f"\n({xc:.1f}x)" if xc is not None else "")
                ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    labels = [_short(m["title"]) for m in runs[0]["modes"]]
    if redis and redis.get("items_per_s"):
        ax.bar([len(labels)], [redis["items_per_s"]], 0.8 / len(runs), color="#777777", label="through Redis")
        labels.append(_short("6"))
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("tickets / s")
    cpu = runs[0]["modes"][0].get("speedup_vs_sequential_cpu") is not None
    ax.set_title(
        "Throughput (wall clock); labels: x vs mode 1" + ("\n(in brackets: x vs mode 1 in CPU time)" if cpu else ""),
        fontsize=10,
    )
    ax.margins(y=0.15)
    ax.legend(fontsize=8)


def _tokens(ax, runs) -> None:
    """Tokens computed per real-work token, split into work, re-computed prefix and padding."""
    run = runs[0]
    modes = run["modes"]
    xs = range(len(modes))
    work = [1.0 for _ in modes]
    prefix = [m["tokens"]["prefix_recomputed"] / m["tokens"]["work"] for m in modes]
    pad = [m["tokens"]["padding"] / m["tokens"]["work"] for m in modes]
    ax.bar(xs, work, color=COLORS["work"], label="ticket tokens (work)")
    ax.bar(xs, prefix, bottom=work, color=COLORS["prefix"], label="prompt prefix re-computed")
    ax.bar(xs, pad, bottom=[a + b for a, b in zip(work, prefix)], color=COLORS["padding"], label="padding")
    for x, m in zip(xs, modes):
        total = m["tokens"]["computed"] / m["tokens"]["work"]
        ax.annotate(f"{total:.1f}x\npad {m['padding_pct']:.0f}%", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [_short(m["title"]) for m in modes], fontsize=8)
    ax.set_ylabel("tokens computed / ticket tokens")
    ax.set_title(f"Where the compute goes ({run['prompt']})")
    ax.set_ylim(0, max(m["tokens"]["computed"] / m["tokens"]["work"] for m in modes) * 1.25)
    ax.legend(fontsize=8, loc="upper right")


def _histogram(ax, run, doc) -> None:
    import matplotlib.ticker
    import numpy as np

    lengths = np.asarray(run["suffix_tokens"])
    hi = max(int(lengths.max()), 2)
    bins = np.unique(np.geomspace(1, hi + 1, 30).astype(int))
    ax.hist(lengths, bins=bins, color=COLORS["work"], alpha=0.85)
    ax.set_xscale("log")
    ax.set_xlim(max(1, lengths.min() / 1.3), hi * 1.3)
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if lengths.min() / 1.3 <= t <= hi * 1.3]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    edges = sorted({b["max_len"] for b in run.get("buckets") or []})
    for i, e in enumerate(edges):
        ax.axvline(
            e, color=COLORS["padding"], lw=0.8, alpha=0.7, label="bucket edge (mode 5 batch max)" if i == 0 else None
        )
    ax.set_xlabel("ticket tokens (text + answer cue), log scale")
    ax.set_ylabel("tickets")
    t = doc["workload"]["text_tokens"]
    ax.set_title(
        f"Ticket lengths ({run['prompt']} prefix {run['prefix_tokens']} tok not shown): text p50 {t['p50']}, "
        f"p99 {t['p99']}, max {t['max']} tok; {doc['workload']['truncated']} truncated"
    )
    if edges:
        ax.legend(fontsize=8)


def _sweep(ax, run) -> None:
    rows = run["sweep"]
    for tok in sorted({r["pass_max_tokens"] for r in rows}):
        pts = sorted((r["pass_max_items"], r["items_per_s"]) for r in rows if r["pass_max_tokens"] == tok)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"pass_max_tokens {tok}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pass_max_items")
    ax.set_ylabel("tickets / s (mode 5)")
    ax.set_title(f"Sweep: where throughput saturates ({run['prompt']})")
    ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    """Re-plot a saved ``--json`` document: ``python -m worker.bench.plot bench.json bench.png``."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m worker.bench.plot BENCH.json OUT.png", file=sys.stderr)
        return 2
    plot(json.loads(Path(args[0]).read_text(encoding="utf-8")), args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
