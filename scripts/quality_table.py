"""The one command behind the quality tables in docs/quality.md and the README.

    python scripts/quality_table.py --markdown out/quality/table.md --json out/quality/table.json

Fits every method on each set's training rows and reports accuracy (ECE) on the reporting sets:
support tickets (the first set's 60 test tickets and the 104 written test tickets nobody fitted on),
CLINC150 10 domains + oos (400 sampled test queries), BANKING77 (500 sampled test queries); sizes and
seeds in worker/quality/suites.py. TF-IDF + logistic regression needs scikit-learn (`pip install
'triage[quality]'`). Pooled states are cached under out/quality-cache/features (first run: about an hour
of one CPU core for the LM passes; re-runs: seconds). Data sets: ../shared/data or TRIAGE_DATA_DIR.
`--tables every-row` alone: MiniLM heads (and the floor) on every training row CLINC150 and BANKING77 ship,
CLINC150 also on fine labels with an `oos` threshold (~12 minutes once the pooled states are cached).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description="side-by-side label quality table")
    ap.add_argument("--suites", default="support,clinc150-domains,banking77")
    ap.add_argument("--head-prompt", choices=["labels", "task"], default=None, help="default: TRIAGE_HEAD_PROMPT")
    ap.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        default="bf16",
        help="bf16 (default): what TRIAGE_DTYPE=auto picks on an idle AVX512-BF16 CPU; pinned, since auto "
        "measures the CPU at start-up and can pick fp32 on a loaded machine",
    )
    ap.add_argument("--cache-dir", type=Path, default=Path("out/quality-cache/features"))
    ap.add_argument(
        "--tables",
        default="main,prompt,every-row",
        help="which tables: main (every method, the suites' training rows), prompt (labels vs task head prompt), "
        "every-row (MiniLM heads on every training row CLINC150 and BANKING77 ship)",
    )
    ap.add_argument("--no-tfidf", action="store_true", help="skip the TF-IDF floor (no scikit-learn needed)")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", dest="json_out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from worker.quality.compare import build_table, every_row_table, head_prompt_table
    from worker.settings import Settings

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    settings = Settings(device="cpu", dtype=args.dtype)
    head_prompt = args.head_prompt or settings.head_prompt
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    names = [s.strip() for s in args.suites.split(",") if s.strip()]
    tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    out, report = [], {"head_prompt": head_prompt, "dtype": args.dtype}
    if "main" in tables:
        main_table = build_table(
            settings, names, head_prompt=head_prompt, log=log, root=args.cache_dir, with_tfidf=not args.no_tfidf
        )
        out += ["## Accuracy (ECE) on held-out test rows", "", main_table.markdown()]
        report["main"] = main_table.to_dict()
    if "prompt" in tables:
        hp = head_prompt_table(settings, root=args.cache_dir, log=log)
        out += ["## Head prompt: labels-only vs the full task prompt (same rows for both)", "", hp.markdown()]
        report["head_prompt_table"] = hp.to_dict()
    if "every-row" in tables:
        er = every_row_table(settings, root=args.cache_dir, log=log, with_tfidf=not args.no_tfidf)
        out += ["## Every training row (same test rows as the main table)", "", er.markdown()]
        report["every_row_table"] = er.to_dict()
    text = "\n".join(out)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
