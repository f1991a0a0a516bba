"""The ``--ids-out`` file of ``triage-producer send``: {id, stream_id} JSON lines, one per ticket sent, which
``wait --from-file`` reads back to wait for the results of those very submissions."""

from __future__ import annotations

import json

from producer.streams import is_entry_id


def write_ids(f, sent: list) -> None:
    """``sent`` as {id, stream_id} JSON lines, replacing what ``f`` held (an ``--ids-out`` file, opened to append)."""
    if f is not None:
        if f.seekable():  # a pipe or /dev/stdout cannot be rewound: it only ever gets this one write
            f.seek(0)
            f.truncate()
        for s in sent:
            f.write(json.dumps({"id": s.ticket_id, "stream_id": s.stream_id}) + "\n")


def read_submissions(path: str) -> list:
    """The ``Submitted`` of an ``--ids-out`` file; ValueError naming the line of a row without a stream entry id
    (``"abc"``, null: it went to Redis and came back as a Redis error, exit 1, for what is bad input)."""
    from producer.client import Submitted

    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            sid = row["stream_id"]
            if not is_entry_id(sid):
                raise ValueError(f"line {n}: stream_id {sid!r} is not a stream entry id such as 1700000000000-0")
            out.append(Submitted(str(row["id"]), sid))
    return out
