"""Joined features (``TRIAGE_ENCODER``) in the bench's accounting: the LM's tokens apart from the encoder's.

The planner prices a ticket at both models' tokens (``Classifier.cost_length``), so a pass's lengths and its
``PassStats`` mix them. The bench's token, FLOP and MFU columns are the LM's (its FLOPs at its shape, against a
GEMM timed at its shape); the encoder's tokens and FLOPs (at the encoder's shape) are reported beside them.
Without an encoder every ticket's encoder length is 0 and nothing here changes a figure.
"""

from __future__ import annotations

from worker.bench.gemm import ModelShape, row_flops
from worker.engine import bucketing


def lm_tokens(run, b: bucketing.Pass, stats) -> tuple[int, int]:
    """(real, computed) LM tokens of pass ``b`` of ``run`` (a ``modes.ModeRun``) from its ``PassStats``."""
    aux = [run.aux_lengths[i] for i in b.indices] if run.aux_lengths else []
    enc = sum(aux)
    if not enc:
        return stats.real_tokens, stats.padded_tokens
    if run.attention == "packed":  # the LM's real tokens plus what its graph shape added
        return stats.real_tokens - enc, stats.padded_tokens - enc
    lm = [n - a for n, a in zip(b.lengths, aux)]  # the LM's rows, padded to their widest (or pad_to)
    return sum(lm), b.size * max(max(lm), run.pad_to or 0)


def lm_passes(run) -> list[bucketing.Pass]:
    """``run.passes`` with the LM's lengths only (what ``gemm.computed_flops`` prices at the LM's shape)."""
    if not any(run.aux_lengths):
        return list(run.passes)
    return [
        bucketing.Pass(b.indices, tuple(n - run.aux_lengths[i] for n, i in zip(b.lengths, b.indices)))
        for b in run.passes
    ]


def encoder_figures(run, shape: ModelShape | None, wall_s: float | None) -> dict | None:
    """The encoder's share of ``run`` (None without one): each pass runs it over the pass's tickets padded to their
    longest (``engine/joined.py``); real tokens, computed tokens and FLOPs at the encoder's shape."""
    if shape is None or not any(run.aux_lengths):
        return None
    rows = [[run.aux_lengths[i] for i in b.indices] for b in run.passes]
    work = sum(row_flops(shape, n) for r in rows for n in r)
    computed = sum(len(r) * row_flops(shape, max(r)) for r in rows)
    return {
        "tokens": {"real": sum(map(sum, rows)), "computed": sum(len(r) * max(r) for r in rows)},
        "flops": {"work": work, "computed": computed, "work_per_s": work / wall_s if wall_s else None},
    }


def joined_note(summaries: list[dict]) -> str:
    """For joined features: the table's columns are the LM's; the encoder's figures per mode ("" without one)."""
    rows = [(m["title"], m["encoder"]) for m in summaries if m.get("encoder")]
    if not rows:
        return ""
    lines = ["joined features: the token, padding, FLOP and MFU columns count the LM only; the encoder's per mode:"]
    for title, e in rows:
        lines.append(
            f"  {title[:31]:31s}  encoder tokens {e['tokens']['real']} real, {e['tokens']['computed']} computed "
            f"(each pass padded to its longest), {e['flops']['computed'] / 1e9:,.2f} GFLOP computed"
        )
    return "\n".join(lines)
