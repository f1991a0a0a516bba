"""Push tickets into the input stream and collect their results: the producer's Python API.

Why a client at all (XADD is one command): ticket ids the caller can wait on,
pipelined submission of thousands of tickets per round trip, backpressure
instead of an input stream that grows without bound (it is never trimmed: that
would drop tickets), and a wait that sleeps on the results streams instead of
hammering Redis with one GET per ticket per poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from producer.redis_errors import AclRefused, WrongType, asking, execute, refusal
from producer.results import Result, as_str
from producer.settings import ProducerSettings
from producer.streams import StreamScan, decode_dead_letter, entry_after, follow, recent
from producer.tickets import InvalidTicket, normalize_at, ticket_fields  # noqa: F401 - ticket_fields: public here too

GET_CHUNK = 1000  # keys per pipelined MGET while waiting
SOCKET_TIMEOUT_S = 15.0  # of the client built here: above any block it uses (as the worker's)


@dataclass(frozen=True)
class Submitted:
    ticket_id: str  # key of the result: TRIAGE_RESULT_KEY_PREFIX + ticket_id
    stream_id: str  # the entry id in the input stream


class BacklogFull(RuntimeError):
    """The input stream holds ``TRIAGE_INPUT_MAX_BACKLOG`` unclassified tickets; nothing more was sent.

    ``submitted`` lists what this call had already sent before the limit hit."""

    def __init__(
        self, backlog: int, limit: int, policy: str, waited_s: float, submitted: list[Submitted] | None = None
    ):
        self.backlog, self.limit, self.policy, self.waited_s = backlog, limit, policy, waited_s
        self.submitted = submitted or []
        how = (
            "refused at once (TRIAGE_BACKPRESSURE=refuse)"
            if policy == "refuse"
            else f"still full after waiting {waited_s:.1f}s"
        )
        super().__init__(
            f"input stream backlog is {backlog} tickets, limit {limit} (TRIAGE_INPUT_MAX_BACKLOG): {how}. "
            "Start more workers, wait, or raise the limit."
        )


class TriageClient:
    """Submit tickets, check the backlog, wait for and read results."""

    def __init__(self, settings: ProducerSettings | None = None, *, client: redis.Redis | None = None):
        self.settings = settings or ProducerSettings()
        self.redis = client or _connect(self.settings.redis_url)

    def _block_ms(self, want_ms: int) -> int:
        """``want_ms`` for an XREAD BLOCK (0: as long as it may), kept under the socket timeout (redis-py 8 defaults
        to 5 s): a longer block would end in a socket TimeoutError instead of an empty reply."""
        kwargs = self.redis.connection_pool.connection_kwargs
        timeout_s = kwargs.get("socket_timeout", kwargs.get("orig_socket_timeout"))
        if not timeout_s:
            return max(0, want_ms)
        cap = max(1, int(timeout_s * 900))  # 90% of it
        return cap if want_ms <= 0 else min(want_ms, cap)

    # ----------------------------------------------------------------- submit
    def submit(self, text: str, *, id: str | None = None, subject: str | None = None, meta: Any = None) -> Submitted:
        """Send one ticket; returns its ticket id (``id`` or a new uuid) and stream id."""
        return self.submit_many([{"text": text, "id": id, "subject": subject, "meta": meta}])[0]

    def submit_many(
        self, tickets: Iterable[str | Mapping[str, Any]], *, on_progress: Callable[[int], None] | None = None
    ) -> list[Submitted]:
        """Send tickets in pipelined chunks (one round trip each), in order.

        Before each chunk the backlog is checked against ``input_max_backlog``
        (``block``: wait up to ``backpressure_timeout_s``; ``refuse``: raise
        ``BacklogFull`` at once). ``on_progress(n)`` is called after each chunk.

        A list or tuple is checked whole first: a bad ticket raises ``InvalidTicket`` with nothing sent. Any other
        iterable is checked as it is read. Whatever stops the call part-way (``InvalidTicket``, ``BacklogFull``, a
        Redis error, Ctrl-C) carries ``submitted``, what was sent, so a caller can resume without duplicates; a Redis
        error or Ctrl-C also carries ``unconfirmed``, the ids of the chunk whose reply was lost (sent or not), and
        ``refused``, those Redis answered with an error (OOM under maxmemory): not added. When Redis refused some,
        every reply came back: ``submitted`` has each ticket it added, also after a refused one, and a resume
        re-sends the refused ones and everything after the first ``len(submitted) + len(refused)`` tickets.
        """
        _many(tickets, "tickets", "submit(text, ...)", mapping_too=True)
        s = self.settings
        size = min(s.submit_chunk_size, s.input_max_backlog) if s.input_max_backlog else s.submit_chunk_size
        done: list[Submitted] = []
        checked = (normalize_at(k, t, done) for k, t in enumerate(tickets))
        chunk: list[tuple[str, dict[str, str]]] = []
        try:
            items = list(checked) if isinstance(tickets, (list, tuple)) else checked
            for item in items:
                chunk.append(item)
                if len(chunk) >= size:
                    self._send_chunk(chunk, done, on_progress)
                    chunk = []
            if chunk:
                self._send_chunk(chunk, done, on_progress)
        except KeyboardInterrupt as e:  # Ctrl-C in a long send: still say what went, to resume after it
            if not hasattr(e, "submitted"):
                e.submitted, e.unconfirmed = list(done), []  # type: ignore[attr-defined]
            raise
        return done

    def _send_chunk(self, chunk, done: list[Submitted], on_progress) -> None:
        try:
            self.wait_for_room(len(chunk))
        except (BacklogFull, redis.RedisError) as e:  # nothing of this chunk went
            e.submitted, e.unconfirmed = list(done), []  # type: ignore[attr-defined]
            raise
        pipe = self.redis.pipeline(transaction=False)
        for _, fields in chunk:
            pipe.xadd(self.settings.input_stream, fields)  # no MAXLEN: trimming would lose tickets
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, KeyboardInterrupt) as e:  # the reply is lost: which of the chunk went is not known
            e.submitted, e.unconfirmed = list(done), [tid for tid, _ in chunk]  # type: ignore[attr-defined]
            raise
        # every reply came back: an error reply (OOM, READONLY, NOPERM) means that ticket was not added; an id, it was
        added = [Submitted(tid, as_str(r)) for (tid, _), r in zip(chunk, replies) if not isinstance(r, Exception)]
        done.extend(added)
        if on_progress and added:
            on_progress(len(added))
        first = next((r for r in replies if isinstance(r, Exception)), None)
        if first is not None:  # a resume re-sends these, then whatever came after this chunk
            first = refusal(first, "XADD", self.settings.input_stream)
            refused = [tid for (tid, _), r in zip(chunk, replies) if isinstance(r, Exception)]
            first.submitted, first.unconfirmed, first.refused = list(done), [], refused  # type: ignore[attr-defined]
            raise first

    # ---------------------------------------------------------- backpressure
    def backlog(self) -> int:
        """Tickets in the input stream not yet classified: the group's lag + pending entries.

        Classified entries stay in the stream (acked, not deleted), so XLEN is not
        the backlog. Without a consumer group (no worker ever ran) every entry waits. A key of another type than a
        stream at ``input_stream`` raises ``WrongType`` (a ``redis.ResponseError``), never a backlog of 0.
        """
        s = self.settings
        groups = self._groups()
        if groups is None:  # no such key: empty
            return 0
        for g in groups:
            if as_str(g.get("name")) != s.group:
                continue
            pending = int(g.get("pending") or 0)
            lag = g.get("lag")
            if lag is not None:
                return int(lag) + pending
            # Redis cannot tell the lag (entries were deleted): count what follows the last delivered id
            last = as_str(g.get("last-delivered-id") or "0-0")
            cap = s.input_max_backlog + 1 if s.input_max_backlog else None
            with asking("XRANGE", s.input_stream):
                return pending + len(self.redis.xrange(s.input_stream, min="(" + last, max="+", count=cap))
        with asking("XLEN", s.input_stream):
            return int(self.redis.xlen(s.input_stream))

    def _groups(self) -> list | None:
        """XINFO GROUPS of the input stream; None when there is no such stream. A refusal of the ACL (``AclRefused``)
        and a key of another type (``WrongType``: a string at TRIAGE_INPUT_STREAM) are raised: read as "no such
        stream", they made the backlog 0 and the look-up of expired results nothing."""
        try:
            with asking("XINFO GROUPS", self.settings.input_stream):
                return self.redis.xinfo_groups(self.settings.input_stream)
        except (AclRefused, WrongType):
            raise
        except redis.ResponseError as e:
            if "no such key" in str(e).lower():
                return None
            raise  # SELECT of a db the server lacks (on connect), a busy script...: read as "empty" it turned
            # backpressure off and made `backlog` say 0

    def wait_for_room(self, n: int = 1) -> None:
        """Return once ``n`` more tickets fit under ``input_max_backlog``; else ``BacklogFull``."""
        s = self.settings
        if not s.input_max_backlog:
            return
        n = min(n, s.input_max_backlog)
        t0 = time.monotonic()
        pause = 0.05
        while True:
            backlog = self.backlog()
            if backlog + n <= s.input_max_backlog:
                return
            waited = time.monotonic() - t0
            if s.backpressure == "refuse" or waited >= s.backpressure_timeout_s:
                raise BacklogFull(backlog, s.input_max_backlog, s.backpressure, waited)
            time.sleep(min(pause, s.backpressure_timeout_s - waited))
            pause = min(pause * 2, 1.0)

    # ---------------------------------------------------------------- results
    def result_key(self, ticket_id: str) -> str:
        return self.settings.result_key_prefix + ticket_id

    def get_results(self, ticket_ids: Iterable[str]) -> dict[str, Result]:
        """Latest results of those tickets that have one (classified or dead-lettered), pipelined."""
        ids = list(_many(ticket_ids, "ticket_ids", "get_result(ticket_id)"))
        out: dict[str, Result] = {}
        for i in range(0, len(ids), GET_CHUNK):
            part = ids[i : i + GET_CHUNK]
            with asking("MGET", self.result_key("*")):
                raws = self.redis.mget([self.result_key(t) for t in part])
            for tid, raw in zip(part, raws):
                if raw is not None:
                    out[tid] = Result.from_json(as_str(raw), ticket_id=tid)
        return out

    def get_result(self, ticket_id: str) -> Result | None:
        return self.get_results([ticket_id]).get(ticket_id)

    def wait(self, tickets: Iterable[str | Submitted], timeout_s: float = 30.0) -> dict[str, Result]:
        """Results for ``tickets``, waiting up to ``timeout_s`` for the missing ones; keyed by ticket id.

        Pass what ``submit``/``submit_many`` returned (``Submitted``) to get the result of THAT
        submission: a result counts only if its ``stream_id`` is the submission's input entry, so
        an id sent again never gets the answer to an earlier send. A plain id string takes the
        latest result of that id, whichever submission it answers.

        Returns what arrived (a dead-lettered ticket arrives with ``status == "dead_letter"`` and
        a ``reason``); ids missing from the dict timed out. A submission whose result key has
        expired (``TRIAGE_RESULT_TTL_S``) but whose input entry the group has acknowledged is
        looked up in the results and dead-letter streams (found unless they were trimmed past it).
        A plain id whose key has expired times out: only the key maps an id to its record, the settled
        input entry is trimmed, and a scan of the streams could not tell that ticket from one not yet
        classified, so every wait on a fresh id would pay it, over up to TRIAGE_RESULTS_MAXLEN records.
        Between checks it blocks on XREAD of the results and dead-letter streams, so it wakes when
        the worker writes, and re-reads only what is still missing.
        """
        want: dict[str, str | None] = {}  # ticket id -> the input entry its result must answer (None: any)
        for t in _many(tickets, "tickets", "result(ticket)"):
            if isinstance(t, Submitted):
                want[t.ticket_id] = t.stream_id
            else:
                want.setdefault(str(t), None)
        if timeout_s != timeout_s:  # NaN: no deadline would ever pass; inf (wait until all arrive) is fine
            raise ValueError("timeout_s is NaN")
        got: dict[str, Result] = {}
        deadline = time.monotonic() + timeout_s
        cursors = self.outcome_tails()
        scan = StreamScan(self)
        max_block_ms = self.settings.wait_poll_max_ms
        first = True
        while True:
            remaining = [t for t in want if t not in got]
            found = self.get_results(remaining)
            for tid, res in found.items():
                expected = want[tid]
                answers = res.fields.get("stream_id")
                if expected is None or answers == expected:
                    got[tid] = res
                elif entry_after(answers, expected):  # a later send of the same id overwrote the key
                    scan.add(tid, expected)
            if first:  # a key that is gone although the worker finished the entry expired: look in the streams
                keyless = {want[t]: t for t in remaining if t not in found and want[t] is not None}
                for sid in self._finished(list(keyless)):
                    scan.add(keyless[sid], sid)
                first = False
            got.update(scan.found())
            left_s = deadline - time.monotonic()
            if len(got) == len(want) or left_s <= 0:
                return got
            block_ms = self._block_ms(max(1, int(min(max_block_ms, left_s * 1000))))
            with asking("XREAD", ", ".join(cursors)):
                woke = self.redis.xread(cursors, count=1, block=block_ms)
            if woke:
                cursors = self.outcome_tails()  # woke on a write: skip past everything written so far
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))  # let a burst of writes land

    def _finished(self, stream_ids: list[str]) -> list[str]:
        """Those input entries the group has delivered and acknowledged: their results were written.

        Delivered = not after the group's last-delivered-id; acknowledged = no longer pending."""
        s = self.settings
        if not stream_ids:
            return []
        groups = self._groups()
        if groups is None:  # no such stream
            return []
        last = next((as_str(g.get("last-delivered-id")) for g in groups if as_str(g.get("name")) == s.group), None)
        delivered = [sid for sid in stream_ids if last is not None and not entry_after(sid, last)]
        pipe = self.redis.pipeline(transaction=False)
        for sid in delivered:
            pipe.xpending_range(s.input_stream, s.group, min=sid, max=sid, count=1)
        replies = execute(pipe, "XPENDING", [s.input_stream] * len(delivered))
        return [sid for sid, rows in zip(delivered, replies) if not rows]

    def result(self, ticket: str | Submitted, timeout_s: float = 30.0) -> Result:
        """One ticket's result (of that submission, given a ``Submitted``).

        ``TimeoutError`` if none within ``timeout_s``.
        """
        ticket_id = ticket.ticket_id if isinstance(ticket, Submitted) else ticket
        got = self.wait([ticket], timeout_s)
        if ticket_id not in got:
            raise TimeoutError(
                f"no result for ticket {ticket_id!r} within {timeout_s}s "
                f"(is a worker running on {self.settings.input_stream!r}?)"
            )
        return got[ticket_id]

    def outcome_tails(self) -> dict[str, str]:
        """Last entry id of the results and dead-letter streams ("0-0" if empty): a ``since`` for
        ``follow_results`` that sees only what is written after this call. ``WrongType`` if either names a key of
        another type (the CLI checks that before a ``send --wait-s`` sends anything)."""
        s = self.settings
        names = (s.results_stream, s.dead_letter_stream)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.xrevrange(name, count=1)
        tails = {}
        for name, rows in zip(names, execute(pipe, "XREVRANGE", names)):
            tails[name] = as_str(rows[0][0]) if rows else "0-0"
        return tails

    def recent_results(self, count: int = 20, *, dead_letters: bool = True) -> list[Result]:
        """The last ``count`` outcomes, oldest first: records of the results stream and (unless ``dead_letters`` is
        False) of the dead-letter stream, merged by entry id; a dead letter has ``status == "dead_letter"``."""
        return recent(self, count, dead_letters)

    def follow_results(
        self,
        since: str | Mapping[str, str] = "$",
        block_ms: int = 1000,
        stop: Callable[[], bool] | None = None,
        *,
        dead_letters: bool = True,
    ) -> Iterator[Result]:
        """Outcomes as the worker writes them: results and (unless ``dead_letters`` is False) dead letters, as
        ``Result`` (``status == "dead_letter"`` with its ``reason``, as ``wait`` returns them).

        ``since``: ``"$"`` only new ones, ``"0"`` from the start, or an entry id: records after it in each stream
        (ids are ``<ms>-<seq>`` times). The two streams number their records apart, so a dead letter written in the
        same millisecond as a result may sort on either side of its id: for an exact resume pass a dict
        ``{results_stream: id, dead_letter_stream: id}`` of the last ``result_entry_id`` seen in each (a stream
        missing from it starts at ``"$"``). ``ValueError`` at once for an id that is none."""
        return follow(self, since, block_ms, stop, dead_letters)

    def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        """The last ``count`` dead-letter records (oldest first), decoded: ``payload`` (the rejected
        entry's fields) as a dict, ``deliveries``, ``dead_at_ms`` and ``payload_bytes`` as ints,
        ``payload_truncated`` as a bool, ``dead_letter_id``."""
        with asking("XREVRANGE", self.settings.dead_letter_stream):
            rows = self.redis.xrevrange(self.settings.dead_letter_stream, count=count)
        return [decode_dead_letter(sid, fields) for sid, fields in reversed(rows)]


def _connect(url: str) -> redis.Redis:
    """The client's connection; a URL redis-py cannot parse is a ``ValueError`` without its secrets (redis-py's own
    message can quote a piece of the password: "Port could not be cast to integer value as '...'")."""
    from worker.redact import mask_unparsed_url, mask_with_url_secrets

    try:
        return redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5
        )
    except ValueError as e:
        why = mask_with_url_secrets(str(e), url)
        shown = mask_with_url_secrets(mask_unparsed_url(url), url)  # (the shapes stop at a space or a quote)
        raise ValueError(f"TRIAGE_REDIS_URL {shown} does not parse: {why}") from None


def _many(arg: Any, name: str, one: str, *, mapping_too: bool = False) -> Any:
    """``arg`` itself, unless it is one ticket where many are wanted: a str is an iterable of characters (and a
    dict one of its keys), so ``wait("T-1")`` waited on "T", "-" and "1" and ``submit_many({"text": ...})`` sent the
    field names as tickets."""
    if isinstance(arg, (str, bytes)) or (mapping_too and isinstance(arg, Mapping)):
        raise TypeError(f"{name}: expected a list or other iterable, got a single {type(arg).__name__}; for one: {one}")
    return arg
