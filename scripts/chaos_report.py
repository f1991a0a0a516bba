#!/usr/bin/env python3
"""Run the chaos suite (tests/integration/chaos) at full size and print the figures table.

    .venv/bin/python scripts/chaos_report.py                 # full size: >= 5,000 tickets / 20 kills, 100,000 backlog
    .venv/bin/python scripts/chaos_report.py --scale quick   # the sizes `make test` uses (about a minute)
    .venv/bin/python scripts/chaos_report.py --from out/chaos.jsonl   # only print the table of an earlier run

Each chaos test appends one JSON object of figures to the report file
(TRIAGE_CHAOS_REPORT); this script starts pytest with TRIAGE_CHAOS_SCALE set,
then turns that file into the Markdown table published in docs/reliability.md.
Exit code: pytest's (0 = every guarantee held).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, load average at the end {os.getloadavg()[0]:.1f}"


def _f(v) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: list[dict]) -> str:
    """One Markdown line per figure, grouped by test, in the order of the issue."""
    by = {}
    for r in rows:
        by.setdefault(r["test"], []).append(r)
    out = ["| area | figure | value |", "|---|---|---|"]

    def add(area: str, name: str, value) -> None:
        out.append(f"| {area} | {name} | {_f(value)} |")

    for r in by.get("kill9", []):
        add("kill -9", "tickets / kills", f"{_f(r['tickets'])} / {r['kills']}")
        add("kill -9", "entries pending at the kills (in flight)", r["pending_at_kills"])
        add("kill -9", "lost", r["lost"])
        add(
            "kill -9",
            "duplicate results (bound: 2 windows per kill)",
            f"{r['duplicates']} (bound {_f(r['duplicate_bound'])})",
        )
    for r in by.get("redis_restart", []):
        add(
            "Redis restart",
            "tickets / outages (down s)",
            f"{_f(r['tickets'])} / {r['outages']} ({', '.join(map(str, r['down_s']))})",
        )
        add("Redis restart", "lost / duplicates", f"{r['lost']} / {r['duplicates']}")
    for r in sorted(by.get("consumer_group", []), key=lambda r: r["workers"]):
        add(
            "consumer group",
            f"{r['workers']} worker(s): tickets/s (per worker)",
            f"{_f(r['tickets_per_s'])} ({', '.join(_f(v) for v in r['per_worker'].values())} tickets)",
        )
        add("consumer group", f"{r['workers']} worker(s): duplicates / lost", f"{r['duplicates']} / {r['lost']}")
    for r in by.get("slow_consumer", []):
        add("slow consumer", "entries frozen (SIGSTOP) / reclaimed", f"{r['frozen_entries']} / {r['reclaimed']}")
        add(
            "slow consumer",
            "stale writes dropped / stale results written",
            f"{r['stale_writes_dropped']} / {r['stale_results_written']}",
        )
        add("slow consumer", "lost / duplicates", f"{r['lost']} / {r['duplicates']}")
    for r in by.get("hostile_input", []):
        add("bad input", "hostile cases / injection tickets", f"{r['cases']} / {r['injection_tickets']}")
        add(
            "bad input",
            "results / dead letters / worker exit",
            f"{r['results']} / {r['dead_letters']} / {r['worker_exit']}",
        )
        add("bad input", "labels seen (configured set only)", ", ".join(r["labels_seen"]))
    for r in by.get("injection_real_model", []):
        add("bad input", "injection texts with SmolLM2 -> labels", f"{r['texts']} -> {', '.join(r['labels'])}")
    for r in by.get("backlog", []):
        add("backlog", "entries drained (window size)", f"{_f(r['backlog'])} ({r['batch_items']})")
        add("backlog", "max entries pending on the worker", r["max_pending"])
        add(
            "backlog",
            "worker RSS MB: min / median early / median late / max",
            f"{r['rss_min_mb']} / {r['rss_median_early_mb']} / {r['rss_median_late_mb']} / {r['rss_max_mb']}",
        )
        add("backlog", "drain time s", r["drain_s"])
        add("backlog", "results XLEN vs MAXLEN", f"{_f(r['results_xlen'])} vs {_f(r['results_maxlen'])}")
        add("backlog", "dead-letter XLEN vs MAXLEN", f"{_f(r['dead_xlen'])} vs {_f(r['dead_maxlen'])}")
        add("backlog", "producer limit / max backlog seen", f"{r['producer_limit']} / {r['producer_max_backlog_seen']}")
    for r in by.get("group_loss_restart", []):
        add(
            "group lost",
            "Redis restarted empty: tickets before / after",
            f"{_f(r['tickets_before'])} / {_f(r['tickets_after'])}",
        )
        add(
            "group lost",
            "after the restart: lost / duplicates / windows dropped",
            f"{r['lost_after']} / {r['duplicates_after']} / {r['windows_dropped']}",
        )
        add(
            "group lost",
            "Redis back -> group recreated / first result s",
            f"{r['group_recreated_after_s']} / {r['first_result_after_restart_s']}",
        )
    for r in by.get("group_loss_destroy", []):
        add(
            "group lost",
            "XGROUP DESTROY: tickets / lost / duplicates",
            f"{_f(r['tickets'])} / {r['lost']} / {r['duplicates']}",
        )
        add("group lost", "destroy -> group recreated s", r["group_recreated_after_s"])
    for r in by.get("input_trim", []):
        add(
            "input trim",
            "XLEN: lagging group / trimmed / TRIAGE_INPUT_TRIM=false",
            f"{r['xlen_with_lagging_group']} / {r['xlen_trimmed']} / {r['xlen_untrimmed']}",
        )
    for r in by.get("long_pass", []):
        add("long pass", "longest window infer ms (heartbeat TTL 1 s, claim idle 0.6 s)", r["max_window_infer_ms"])
        add("long pass", "heartbeat missing / samples", f"{r['heartbeat_missing']} / {r['heartbeat_samples']}")
        add("long pass", "entries reclaimed from a live worker", r["reclaimed_from_live_worker"])
    for r in by.get("window_passes", []):
        add("window / pass", "window / pass cap / passes", f"{r['window']} / {r['pass_cap']} / {r['passes']}")
        add(
            "window / pass",
            "samples with results before the window's last pass",
            f"{r['partial_samples']} of {r['samples']}",
        )
    for r in by.get("tls", []):
        leaked = "yes" if r["password_in_logs"] else "no"
        add("security", "TLS + password: results / password in logs", f"{r['results']} / {leaked}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=["quick", "full"], default="full")
    ap.add_argument(
        "--report", type=Path, default=REPO / "out" / "chaos.jsonl", help="where the figures go (JSON lines)"
    )
    ap.add_argument(
        "--spawn",
        choices=["fork", "exec"],
        default=None,
        help="how workers start: fork (from a pre-imported server; default) or exec (python -m worker)",
    )
    ap.add_argument("--from", dest="from_file", type=Path, help="print the table of an existing report, run nothing")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments, e.g. -k kill9")
    args = ap.parse_args(argv)

    code = 0
    report = args.from_file or args.report
    if not args.from_file:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.unlink(missing_ok=True)
        env = {**os.environ, "TRIAGE_CHAOS_SCALE": args.scale, "TRIAGE_CHAOS_REPORT": str(report)}
        if args.spawn:
            env["TRIAGE_TEST_SPAWN"] = args.spawn
        t0 = time.monotonic()
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/integration/chaos",
                *args.pytest_args,
            ],
            cwd=REPO,
            env=env,
        )
        print(f"\nchaos suite ({args.scale}): pytest exit {code} in {time.monotonic() - t0:.0f} s")
    rows = [json.loads(line) for line in report.read_text().splitlines() if line.strip()] if report.exists() else []
    if not rows:
        print(f"no figures in {report}", file=sys.stderr)
        return code or 1
    scales = sorted({r.get("scale", "?") for r in rows})
    print(f"\nChaos figures ({', '.join(scales)} scale; {machine()}):\n")
    print(table(rows))
    return code


if __name__ == "__main__":
    sys.exit(main())
