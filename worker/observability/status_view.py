"""The human form of a status snapshot: a few header lines and one row per worker (like ``rq info``).

Pure: takes the dict ``status.collect`` returns, returns text.
"""

from __future__ import annotations

import time
from pathlib import PurePath
from typing import Any

from worker.wording import count_of

COLUMNS = ("WORKER", "STATE", "HOST", "PID", "BEAT", "PHASE", "PENDING", "IDLE", "DONE", "MODEL", "FLAGS")


def render(s: dict[str, Any], redis_url: str = "") -> str:
    q, res, dead, summ = s["queue"], s["results"], s["dead_letters"], s["summary"]
    window = f"{res['window_s']:g}s"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(s["time_ms"] / 1000))
    lines = [f"triage status  {redis_url}  stream {s['stream']}  group {s['group']}  {when}"]
    if not q["exists"]:
        lines.append(f"queue    group {s['group']!r} does not exist on {s['stream']!r} yet (no worker has started)")
    else:
        lines.append(f"queue    backlog {_n(q['backlog'])}  pending {_n(q['pending'])}  length {_n(q['length'])}")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(dead["by_reason"].items(), key=lambda kv: -kv[1]))
    lines.append(
        f"dead     {_n(dead['length'])} dead letters, {dead['in_window']} in the last {window}"
        + (f" ({reasons})" if reasons else "")
    )
    lat = res["latency_ms"]
    newest = "none yet" if res["newest_age_s"] is None else f"newest {_dur(res['newest_age_s'])} ago"
    rate = (  # capped at --max-results: more may be in the window; the rate is over the newest results' span
        f"{res['count']:,}+ in the last {window} ({res['per_s']:g}/s over the newest {res['count']:,}, "
        f"the last {_dur(res['span_s'])})"
        if res.get("capped")
        else f"{res['count']} in the last {window} ({res['per_s']:g}/s)"
    )
    lines.append(
        f"results  {rate}  latency p50 {_ms(lat['p50'])}  p90 {_ms(lat['p90'])}  p99 {_ms(lat['p99'])}  {newest}"
    )
    lines.append("")
    rows = [COLUMNS] + [_row(w, window) for w in s["workers"]]
    if len(rows) == 1:
        lines.append("no workers: no live heartbeat and no consumer in the group")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    tail = f"{count_of(summ['workers'], 'worker')}: {summ['alive']} alive, {summ['dead']} dead, {summ['gone']} gone"
    if summ["dead"]:
        tail += (
            f"; {summ['pending_on_dead']} entries pending on dead workers ({summ['reclaimable']} reclaimable now,"
            f" the rest after TRIAGE_CLAIM_IDLE_MS={s['claim_idle_ms']})"
        )
    lines.append(tail)
    return "\n".join(lines)


def _row(w: dict[str, Any], window: str) -> tuple[str, ...]:
    phase = w["phase"] or "-"
    if w["phase"] and w["phase_age_s"] is not None:
        phase += f" {_dur(w['phase_age_s'])}"
    if w["pass_age_s"] is not None and w["phase"] in ("inferring", "stopping"):  # a pass runs
        phase += f" (pass {_dur(w['pass_age_s'])})"
    return (
        w["consumer"],
        w["state"],
        w["host"] or "-",
        str(w["pid"] or "-"),
        "-" if w["heartbeat_age_s"] is None else _dur(w["heartbeat_age_s"]),
        phase,
        str(w["pending"]),
        "-" if w["idle_s"] is None else _dur(w["idle_s"]),
        f"{w['done_in_window']}/{window}",
        _model(w["model"]),
        ",".join(w["flags"]),
    )


def _model(m: str | None) -> str:
    if not m:
        return "-"
    return PurePath(m).name if m.count("/") > 1 else m  # a local path: its last part; an HF id (org/name) as is


def _n(v: Any) -> str:
    return "?" if v is None else f"{v:,}"


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f} ms" if v < 1000 else f"{v / 1000:.1f} s"


def _dur(s: float) -> str:
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
