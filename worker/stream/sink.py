"""Writing an outcome: results, latest-result keys, dead letters and the XACK, in ONE atomic step.

Atomic on purpose: an entry is acknowledged in the same step that stores its result
(or dead letter), so no crash between two calls can ack a ticket whose result does not
exist, and no crash can store a result whose entry stays unacked without the reclaim
path knowing (it would just be classified again).

The step is the settle script (``scripts.py``), not a MULTI/EXEC, because it must look
before it writes: it writes and acks only the entries still pending on this consumer
(another worker may have reclaimed them; a lost reply may hide that an earlier attempt
committed), and a lost consumer group aborts it before anything is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import redis

from worker.stream.messages import as_text
from worker.stream.scripts import error_code, settle_script
from worker.stream.source import id_order, recovery_key

# one encoder for every record: json.dumps with any non-default option builds a new JSONEncoder per call
_to_json = json.JSONEncoder(ensure_ascii=False).encode


class PartialWriteError(RuntimeError):
    """A key the worker writes holds another Redis type (e.g. a string where the results stream should be).

    Refused before anything was written; the worker stops so that an operator fixes the key."""


class GroupLost(RuntimeError):
    """The consumer group (or the whole input stream) is gone: NOGROUP. Nothing was written."""


class WriteRefused(RuntimeError):
    """Redis refuses the worker a command or a key the settle script needs (an ACL without it: NOPERM). Retrying
    cannot help and would write the records before the refusal again on every attempt: the worker stops."""


# how Redis words a refused permission: NOPERM (a command), and inside a script (Redis 7) "... can't run this command"
# or "... can't access at least one of the keys"
_PERMISSION = re.compile(r"\bNOPERM\b|can't run this command|can't access|no permissions", re.IGNORECASE)


def is_permission_error(message: str) -> bool:
    return bool(_PERMISSION.search(message))


class WriteFailed(RuntimeError):
    """Redis refused a record (e.g. OOM). Nothing was acknowledged; retrying is safe (records already
    written in the failed attempt may be written again: duplicates after a fault, same stream_id)."""


@dataclass
class Outcome:
    """Everything one window (or one pass of it) produced, ready to write."""

    results: list[dict[str, str]] = field(default_factory=list)  # result_fields() records
    dead_letters: list[dict[str, str]] = field(default_factory=list)  # dead_letter_fields() records
    ack_ids: list[str] = field(default_factory=list)  # every input entry id this outcome settles

    def only(self, ids: set[str]) -> Outcome:
        """The part of this outcome for entries in ``ids`` (the rest was settled elsewhere)."""
        return Outcome(
            results=[r for r in self.results if r.get("stream_id") in ids],
            dead_letters=[d for d in self.dead_letters if d.get("stream_id") in ids],
            ack_ids=[i for i in self.ack_ids if i in ids],
        )

    def __bool__(self) -> bool:
        return bool(self.results or self.dead_letters or self.ack_ids)


@dataclass
class Written:
    """What a write did: the part of the outcome that was written and acked, and the ids it skipped."""

    outcome: Outcome
    not_ours: list[str]  # pending on another consumer now, or already acked by an earlier attempt
    lost_from_group: list[str] = field(default_factory=list)  # pending on no one, no record: written, no ack

    def log_skipped(self, log, retry: int) -> None:
        """A warning for the entries the write skipped, and one for those it wrote with nothing to acknowledge."""
        if self.not_ours:
            log.warning(
                "entries_not_ours_anymore",
                count=len(self.not_ours),
                retry=retry,
                note="acked by an earlier attempt, or reclaimed by another worker: not written again",
            )
        if self.lost_from_group:
            log.warning(
                "entries_lost_from_group",
                count=len(self.lost_from_group),
                note="pending on no consumer and settled by no one (the group destroyed and created again at '$', "
                "or XACKed by hand): their records written, nothing to acknowledge",
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
        consumer: str | None = None,
        trim_input: bool = False,
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
        self.consumer = consumer  # None: write everything given, no ownership check (tools, tests)
        self.trim_input = trim_input
        # the lowest id this process holds but those given (the write's own): the trim stays below it
        self.held_floor: Callable[[Collection[str]], str | None] | None = None

    @classmethod
    def for_worker(cls, client: redis.Redis, settings, *, owned: bool = True) -> ResultSink:
        """The stream worker's sink, from its ``Settings``; ``owned=False``: no ownership check (records of entries
        no longer pending anywhere, which the check would skip)."""
        return cls(
            client,
            input_stream=settings.input_stream,
            group=settings.group,
            results_stream=settings.results_stream,
            dead_letter_stream=settings.dead_letter_stream,
            result_key_prefix=settings.result_key_prefix,
            result_ttl_s=settings.result_ttl_s,
            results_maxlen=settings.results_maxlen,
            dead_letter_maxlen=settings.dead_letter_maxlen,
            consumer=settings.consumer if owned else None,
            trim_input=settings.input_trim,
        )

    def result_key(self, ticket_id: str) -> str:
        return self.result_key_prefix + ticket_id

    def _trim_arg(self, settling: Sequence[str]) -> str:
        """'0' no trim; '1' trim below what the groups still need; an id: that, and below this process's lowest held
        entry (a window its group lost, created again at '$', is then still in the stream when it is written) other
        than those this write settles (a window's last write left the window in the stream, capped at its own)."""
        if not self.trim_input:
            return "0"
        return (self.held_floor(frozenset(settling)) if self.held_floor is not None else None) or "1"

    def write(self, outcome: Outcome) -> Written:
        """Results (+ latest keys), dead letters (+ key if the id is known) and XACK, in one atomic script.

        With a ``consumer``, only entries still pending on it are written and acked."""
        if not outcome:
            return Written(Outcome(), [])
        keys = [
            self.input_stream,
            self.results_stream,
            self.dead_letter_stream,
            recovery_key(self.input_stream, self.group),
        ]
        args: list = [
            self.group,
            self.consumer or "",
            self.results_maxlen,
            self.dead_letter_maxlen,
            self.result_ttl_s,
            self._trim_arg(outcome.ack_ids),
            len(outcome.ack_ids),
            *outcome.ack_ids,
        ]
        # Each record travels as one JSON string (what its latest-result key holds anyway) plus the number of
        # its field layout, sent once per write: 5 arguments a record instead of 5 + 2 per field. Packing
        # ~25 arguments a result was most of a write's time on the writer thread, under the interpreter lock.
        layouts: dict[tuple[str, ...], int] = {}
        layout_args: list = []
        record_args: list = []
        for kind, rec in _records(outcome):
            names = tuple(rec)
            layout = layouts.get(names)
            if layout is None:
                layout = layouts[names] = len(layouts) + 1
                layout_args += [len(names), *names]
            # with a ticket id, a caller waiting on it learns its result, or that it never gets one and why
            has_key = "id" in rec
            if has_key:
                keys.append(self.result_key(rec["id"]))
            value = _to_json({"status": "ok" if kind == "r" else "dead_letter", **rec})
            record_args += [kind, rec.get("stream_id", ""), "1" if has_key else "0", value, layout]
        args += [len(layouts), *layout_args, *record_args]
        try:
            reply = settle_script(self.client, keys, args)
        except redis.ResponseError as e:
            if error_code(e) == "NOGROUP":
                raise GroupLost(str(e)) from e
            if error_code(e) == "WRONGTYPE":
                raise PartialWriteError(str(e)) from e
            if is_permission_error(str(e)):
                raise WriteRefused(str(e)) from e
            raise
        where, _, error = as_text(reply[2]).rpartition("\t")  # "XADD triage:results", Redis's own words
        n_lost = int(reply[3])
        lost = [as_text(i) for i in reply[4 : 4 + n_lost]]
        not_ours = [as_text(i) for i in reply[4 + n_lost :]]
        if error and is_permission_error(error):  # Redis's words only: the key may hold a ticket id
            raise WriteRefused(f"Redis refused the worker a command, nothing acknowledged: {where}: {error}")
        if error:
            raise WriteFailed(f"Redis refused a record, nothing acknowledged: {where}: {error}")
        return Written(outcome.only(set(outcome.ack_ids) - set(not_ours)) if not_ours else outcome, not_ours, lost)


def _records(outcome: Outcome) -> list[tuple[str, dict[str, str]]]:
    """Results and dead letters in input-entry order, so that of two entries with the same ticket id
    in one write, the later one's record is the latest-result key (last write wins, as across writes)."""
    recs = [("r", r) for r in outcome.results] + [("d", d) for d in outcome.dead_letters]
    # a record without a stream id (tools writing records by hand) goes after the real ones, in given order
    return sorted(recs, key=lambda kr: id_order(kr[1].get("stream_id", "")))
