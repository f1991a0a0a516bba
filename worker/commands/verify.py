"""Classify tickets the production way (length buckets + prefix KV cache) and the reference way
(each ticket alone, unpadded, no cache, same dtype) and report whether the answers agree.

Exit status 0 when they agree (in fp32: every label, and every probability within 1e-4; in fp16/bf16:
flips only where the reference's top-2 margin is below --flip-margin), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker.commands.model_flags import add_model_arguments, settings_from_args

NAME = "verify"
HELP = "check batched results against an unpadded one-at-a-time reference run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        required=True,
        type=Path,
        help="JSON Lines with a 'text' field (optional 'id'), or CSV with a 'text' column",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N tickets")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write the full report here")
    add_model_arguments(p)
    p.add_argument(
        "--flip-margin",
        type=float,
        default=0.05,
        help="in fp16/bf16, label flips are accepted below this reference top-2 margin",
    )


def run(args: argparse.Namespace) -> int:
    from worker.assemble import build_classifier
    from worker.engine.types import InvalidTicket
    from worker.engine.verify import verify
    from worker.progress import Progress
    from worker.ticket_files import read_tickets

    settings = settings_from_args(args, scorer=True)  # task, model, head and scorer checked before anything loads
    rows = read_tickets(args.input, args.limit)
    clf = build_classifier(settings)
    prepared = clf.prepare([str(r["text"]) for r in rows])
    keep = [i for i, p in enumerate(prepared) if not isinstance(p, InvalidTicket)]
    skipped = len(rows) - len(keep)
    items = [prepared[i] for i in keep]
    ids = [str(rows[i].get("id", i)) for i in keep]
    if not items:  # a PASS over no ticket would say the fast paths were checked
        first = next((p for p in prepared if isinstance(p, InvalidTicket)), None)
        print(
            f"triage-worker verify: nothing to verify: none of the {len(rows)} tickets is valid"
            + (f" (the first: {first})" if first is not None else ""),
            file=sys.stderr,
        )
        return 2
    with Progress(len(items), "reference (one at a time)") as bar:  # a bar on a terminal, log lines elsewhere
        report = verify(clf, items, ids, progress=bar.update)

    ok = report.passed(args.flip_margin)
    out = sys.stdout
    print(
        f"model {settings.model}  device {report.device}  dtype {report.dtype}  "
        f"prefix cache {'on' if report.prefix_cache else 'off'}  attention {report.attention}"
        + (f"  CUDA graph passes {report.cuda_graph_passes}" if report.cuda_graph_passes is not None else ""),
        file=out,
    )
    print(
        f"tickets {report.n} (skipped invalid: {skipped})  passes {report.passes}  padding {report.padding_pct:.1f}%",
        file=out,
    )
    print(f"label agreement {report.agreement_pct:.2f}%   max |dprob| {report.max_abs_delta_prob:.2e}", file=out)
    print(
        f"items/s batched {report.batched_items_per_s:.1f}  reference {report.reference_items_per_s:.1f}  "
        f"({report.speedup:.1f}x)",
        file=out,
    )
    for d in report.disagreements[:20]:
        print(
            f"  flip #{d.index} id={d.id}: batched={d.batched_label} reference={d.reference_label} "
            f"reference top-2 margin={d.reference_margin:.4f} |dprob|={d.max_abs_delta:.2e}",
            file=out,
        )
    print("PASS" if ok else "FAIL", file=out)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        data = report.to_dict() | {"model": settings.model, "skipped_invalid": skipped, "passed": ok}
        args.json_out.write_text(json.dumps(data, indent=2))
    return 0 if ok else 1
