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

from worker.commands.arg_types import at_least
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
    p.add_argument("--limit", type=at_least(1), default=None, help="only the first N tickets")
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

    settings = settings_from_args(args, scorer=True)  # task, model, head and scorer checked before anything loads
    try:
        rows, all_ids = read_rows(args.input, args.limit)
    except ValueError as e:  # before the model loads: one line naming the file's line
        print(f"triage-worker verify: {e}", file=sys.stderr)
        return 2
    clf = build_classifier(settings)
    prepared = clf.prepare([r["text"] for r in rows])  # a null or a number is an invalid ticket, not "None"
    keep = [i for i, p in enumerate(prepared) if not isinstance(p, InvalidTicket)]
    skipped = len(rows) - len(keep)
    items = [prepared[i] for i in keep]
    ids = [all_ids[i] for i in keep]
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


_KIND = {dict: "a dict (a JSON object)", list: "a list (a JSON array)", bool: "a boolean"}


def read_rows(path: Path, limit: int | None) -> tuple[list[dict], list[str]]:
    """The file's tickets and the id the report names each by (no id: its position), or a ``ValueError`` naming
    ``file:line``: a file that cannot be read, or an id that is neither a string nor a finite number. ``str()``
    made an object id the id "{'a': 1}", which is in no file, and a null id "None"."""
    import math

    from worker.ticket_files import TicketFileError, read_numbered

    try:
        numbered = read_numbered(path, limit)
    except (OSError, TicketFileError) as e:  # not UTF-8, an unreadable CSV, a bad row: one line each
        raise ValueError(str(e)) from None
    ids = []
    for i, (line, row) in enumerate(numbered):
        given = row.get("id")
        if given is None or given == "":
            ids.append(str(i))
        elif isinstance(given, str) or (
            isinstance(given, (int, float)) and not isinstance(given, bool) and math.isfinite(given)
        ):
            ids.append(str(given))
        else:
            kind = _KIND.get(type(given)) or f"a {type(given).__name__}"
            raise ValueError(
                f"{path}:{line}: ticket {i + 1} of the file: id must be a string or a finite number, got {kind}: "
                f"{given!r:.60}"
            )
    return [row for _, row in numbered], ids
