"""Writing a batch's outcome: results, latest-result keys, dead letters and the XACK, in ONE MULTI/EXEC.

Atomic on purpose: an entry is acknowledged in the same transaction that stores
its result (or dead letter), so no crash between two calls can ack a ticket
whose result does not exist, and no crash can store a result whose entry stays
unacked without the reclaim path knowing (it would just be classified again).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis


class PartialWriteError(RuntimeError):
    """EXEC ran but some command inside failed (e.g. WRONGTYPE: a key of another type holds a stream name).

    Redis does not roll back: the acks inside may have succeeded. The worker stops
    on this so that an operator fixes the key instead of tickets being acked without results."""


@dataclass
class Outcome:
    """Everything one window produced, ready to write."""

    results: list[dict[str, str]] = field(default_factory=list)  # result_fields() records
    dead_letters: list[dict[str, str]] = field(default_factory=list)  # dead_letter_fields() records
    ack_ids: list[str] = field(default_factory=list)  # every input entry id this outcome settles

    def only(self, ids: set[str]) -> "Outcome":
        """The part of this outcome for entries in ``ids`` (the rest was settled elsewhere)."""
        return Outcome(
            results=[r for r in self.results if r.get("stream_id") in ids],
            dead_letters=[d for d in self.dead_letters if d.get("stream_id") in ids],
            ack_ids=[i for i in self.ack_ids if i in ids],
        )


class ResultSink:
    def __init__(
        self,
        client: redis.Redis,
        *,
        input_stream: str,
        group: str,
        results_stream: str,
        dead_letter_stream: str,
        result_key_prefix: str,
        result_ttl_s: int,
        results_maxlen: int,
        dead_letter_maxlen: int,
    ):
        self.client = client
        self.input_stream = input_stream
        self.group = group
        self.results_stream = results_stream
        self.dead_letter_stream = dead_letter_stream
        self.result_key_prefix = result_key_prefix
        self.result_ttl_s = result_ttl_s
        self.results_maxlen = results_maxlen
        self.dead_letter_maxlen = dead_letter_maxlen

    def result_key(self, ticket_id: str) -> str:
        return self.result_key_prefix + ticket_id

    def write(self, outcome: Outcome) -> None:
        """One MULTI/EXEC: XADD results (+ latest key), XADD dead letters (+ key if the id is known), XACK."""
        if not outcome.ack_ids and not outcome.results and not outcome.dead_letters:
            return
        pipe = self.client.pipeline(transaction=True)
        for r in outcome.results:
            pipe.xadd(self.results_stream, r, maxlen=self.results_maxlen, approximate=True)
            pipe.set(self.result_key(r["id"]), json.dumps({"status": "ok", **r}, ensure_ascii=False), ex=self.result_ttl_s)
        for d in outcome.dead_letters:
            pipe.xadd(self.dead_letter_stream, d, maxlen=self.dead_letter_maxlen, approximate=True)
            if "id" in d:  # a caller waiting on this ticket learns it will never get a label, and why
                pipe.set(self.result_key(d["id"]), json.dumps({"status": "dead_letter", **d}, ensure_ascii=False), ex=self.result_ttl_s)
        if outcome.ack_ids:
            pipe.xack(self.input_stream, self.group, *outcome.ack_ids)
        replies = pipe.execute(raise_on_error=False)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            raise PartialWriteError(f"{len(errors)} of {len(replies)} commands in the write transaction failed: {errors[0]}")
