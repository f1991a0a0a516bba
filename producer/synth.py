"""Synthetic support tickets with a realistic, long-tailed length distribution.

Why: batching by token length only pays off when lengths vary the way real
helpdesk traffic does: most tickets are one or two sentences, a few are pasted
logs or forwarded email threads. The benchmark, the demo and ``make verify``
need such a stream without shipping real customer data.

Lengths (words = ``len(text.split())``) follow a fixed quantile curve: median 23,
p90 89, p99 300, max 950. Each ticket's text is assembled from per-category
templates (greeting, issue, details, closing) and, in the long tail, pasted
material (logs, stack traces, invoices, tracking histories, email threads).
One ``random.Random(seed)`` drives everything, so output is reproducible and
``generate_tickets(n)[:k] == generate_tickets(k)``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Iterator

from producer import synth_attachments as A
from producer import synth_phrases as P

LABELS: tuple[str, ...] = tuple(P.LABEL_WEIGHTS)

# (cumulative probability, words): the inverse CDF, interpolated in log space.
LENGTH_KNOTS: tuple[tuple[float, int], ...] = (
    (0.0, 3),
    (0.05, 7),
    (0.25, 13),
    (0.5, 23),
    (0.75, 46),
    (0.9, 89),
    (0.95, 140),
    (0.99, 300),
    (0.999, 620),
    (1.0, 950),
)
_KNOT_P = [p for p, _ in LENGTH_KNOTS]
_KNOT_LOGW = [math.log(w) for _, w in LENGTH_KNOTS]

SHORT_MAX_WORDS = 8  # at or below: a terse fragment ("charged twice pls help")
ATTACH_MIN_WORDS = 110  # at or above: usually pasted material (logs, threads)


def sample_length(rng: random.Random) -> int:
    """One ticket length in words, drawn from ``LENGTH_KNOTS``."""
    u = rng.random()
    k = min(max(bisect.bisect_right(_KNOT_P, u), 1), len(_KNOT_P) - 1)
    p0, p1 = _KNOT_P[k - 1], _KNOT_P[k]
    frac = (u - p0) / (p1 - p0)
    return int(round(math.exp(_KNOT_LOGW[k - 1] + frac * (_KNOT_LOGW[k] - _KNOT_LOGW[k - 1]))))


_SLOT_VALUES: dict[str, Callable[[random.Random], object]] = {
    "name": lambda r: r.choice(P.FIRST_NAMES),
    "surname": lambda r: r.choice(P.SURNAMES),
    "company": lambda r: r.choice(P.COMPANIES),
    "email": lambda r: (
        f"{r.choice(P.FIRST_NAMES).lower()}.{r.choice(P.SURNAMES).lower()}{r.randint(1, 99)}@example.com"
    ),
    "years": lambda r: r.randint(2, 12),
    "date": lambda r: r.choice(P.WHEN),
    "customer": lambda r: f"C{r.randint(100000, 999999)}",
    "ticket": lambda r: f"#{r.randint(10000, 99999)}",
    "plan": lambda r: r.choice(P.PLANS),
    "amount": lambda r: f"{r.choice('$€£')}{r.randint(5, 499)}.{r.choice(('00', '99', '49', '95'))}",
    "invoice": lambda r: f"INV-{r.randint(2021, 2025)}-{r.randint(1, 9999):05d}",
    "order": lambda r: r.choice(("#", "", "A-")) + str(r.randint(100000, 9999999)),
    "days": lambda r: r.randint(3, 30),
    "last4": lambda r: f"{r.randint(0, 9999):04d}",
    "coupon": lambda r: r.choice(("SPRING", "WELCOME", "SAVE", "VIP")) + str(r.randint(5, 50)),
    "seats": lambda r: r.randint(2, 250),
    "device": lambda r: r.choice(P.DEVICES),
    "app": lambda r: r.choice(P.APPS),
    "error": lambda r: r.choice(P.ERRORS),
    "code": lambda r: r.choice((400, 401, 403, 404, 409, 429, 500, 502, 503, 504)),
    "version": lambda r: f"{r.randint(1, 9)}.{r.randint(0, 20)}.{r.randint(0, 9)}",
    "user": lambda r: f"{r.choice(P.FIRST_NAMES).lower()}_{r.randint(1, 9999)}",
    "tracking": lambda r: f"1Z{r.randint(10**9, 10**10 - 1)}{r.randint(10**5, 10**6 - 1)}",
    "carrier": lambda r: r.choice(P.CARRIERS),
    "product": lambda r: r.choice(P.PRODUCTS),
    "country": lambda r: r.choice(P.COUNTRIES),
    "city": lambda r: r.choice(P.CITIES),
    "address": lambda r: f"{r.randint(1, 250)} {r.choice(P.STREETS)}, {r.choice(P.CITIES)}",
    "phone": lambda r: f"+1 555 {r.randint(100, 999)} {r.randint(1000, 9999)}",
    "company_domain": lambda r: f"www.{r.choice(P.COMPANIES).split()[0].lower()}.example",
    "path": lambda r: r.choice(("sync", "users", "orders", "files/upload", "auth/token", "reports")),
    "n": lambda r: r.randint(2, 900),
    "attempt": lambda r: r.randint(1, 5),
    "hex": lambda r: f"{r.getrandbits(32):08x}",
}


class _Slots(dict):
    """``str.format_map`` mapping that invents a fresh value for every placeholder."""

    def __init__(self, rng: random.Random):
        super().__init__()
        self.r = rng

    def __missing__(self, key: str) -> str:
        return str(_SLOT_VALUES[key](self.r))


def _fill(template: str, rng: random.Random) -> str:
    return template.format_map(_Slots(rng))


def _trim(text: str, n_words: int, *, sentence: bool) -> str:
    words = text.split()
    if len(words) <= n_words:
        return text
    cut = " ".join(words[:n_words])
    if sentence and cut[-1] not in ".?!:,":
        cut = cut.rstrip(",;") + "..."
    return cut


def _take(rng: random.Random, pieces: Iterator[str], budget: int, *, sentence: bool = True) -> list[str]:
    """Pieces from an endless iterator until exactly ``budget`` words.

    Sentences (``sentence=True``) are kept whole where possible: a few draws look
    for one that fits and the last 1-4 words come from ``TAILS``; pasted lines
    (logs) are simply cut, as a truncated paste would be.
    """
    out: list[str] = []
    while budget > 0:
        if sentence and budget <= 2 * max(P.TAILS):
            k = min(budget, max(P.TAILS))
            out.append(rng.choice(P.TAILS[k]))
            budget -= k
            continue
        piece = next(pieces)
        n = len(piece.split())
        for _ in range(5 if sentence else 0):
            if n <= budget:
                break
            piece = next(pieces)
            n = len(piece.split())
        if n > budget:
            piece, n = _trim(piece, budget, sentence=sentence), budget
        out.append(piece)
        budget -= n
    return out


_DETAIL_POOLS = {label: bank["detail"] + P.GENERIC_DETAILS for label, bank in P.CATEGORIES.items()}


def _details(rng: random.Random, label: str) -> Iterator[str]:
    """Detail sentences for ``label``; no template repeats until the pool is used up."""
    pool, used = _DETAIL_POOLS[label], set()
    while True:
        if len(used) == len(pool):
            used.clear()
        i = rng.randrange(len(pool))
        if i not in used:
            used.add(i)
            yield _fill(pool[i], rng)


def _pick_short(rng: random.Random, templates: list[str], max_words: int) -> str:
    """A template of at most ``max_words`` words, filled (their slots are single words)."""
    return _fill(rng.choice([t for t in templates if len(t.split()) <= max_words]), rng)


def _short(rng: random.Random, label: str, target: int) -> str:
    """Terse tickets ("refund please asap"): a fragment padded with fillers to ``target`` words."""
    parts = [_pick_short(rng, P.CATEGORIES[label]["short"], target)]
    words = len(parts[0].split())
    while words < target:
        parts.append(_pick_short(rng, P.FILLERS, target - words))
        words += len(parts[-1].split())
    text = " ".join(parts)
    return text.lower() if rng.random() < 0.3 else text[0].upper() + text[1:]


def _log_lines(rng: random.Random) -> Iterator[str]:
    t = rng.randint(0, 80_000)
    while True:
        t += rng.randint(0, 40)
        stamp = (
            f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            f"T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}.{rng.randint(0, 999):03d}Z"
        )
        if rng.random() < 0.2:
            yield "    " + _fill(rng.choice(A.STACK_FRAMES), rng)
        else:
            comp = f"{rng.choice(A.LOG_COMPONENTS)}-{rng.randint(1, 8)}"
            yield f"{stamp} {rng.choice(A.LOG_LEVELS)} [{comp}] {_fill(rng.choice(A.LOG_MESSAGES), rng)}"


def _invoice_lines(rng: random.Random) -> Iterator[str]:
    while True:
        status = rng.choice(("paid", "paid", "refunded", "failed", "pending"))
        yield (
            f"{_fill('{invoice}', rng)}  2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}  "
            f"{_fill('{plan}', rng)}  {_fill('{amount}', rng)}  {status}"
        )


def _tracking_lines(rng: random.Random) -> Iterator[str]:
    while True:
        yield (
            f"{rng.choice(('Mar', 'Apr', 'May', 'Jun'))} {rng.randint(1, 28):02d} "
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}  "
            f"{rng.choice(P.CITIES).upper()}  {rng.choice(A.TRACKING_EVENTS)}"
        )


def _login_lines(rng: random.Random) -> Iterator[str]:
    while True:
        ip = f"{rng.choice((203, 198, 192))}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
        yield (
            f"2024-05-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} UTC  "
            f"{rng.choice(A.LOGIN_EVENTS)}  IP {ip}  "
            f"{rng.choice(('Chrome', 'Safari', 'Firefox', 'Edge'))} on {_fill('{device}', rng)}"
        )


def _email_thread(rng: random.Random, label: str) -> Iterator[str]:
    """A forwarded thread: alternating agent replies and quoted customer messages."""
    issues, details = P.CATEGORIES[label]["issue"], _details(rng, label)
    while True:
        yield "-----Original Message-----"
        yield _fill("From: Support Team <support@example.com>  Sent: {date}  Subject: Re: Ticket {ticket}", rng)
        yield from rng.sample(A.AGENT_LINES, rng.randint(2, 4))
        yield _fill("On {date}, {name} wrote:", rng)
        yield "> " + _fill(rng.choice(issues), rng)
        for _ in range(rng.randint(1, 4)):
            yield "> " + next(details)


_BLOCKS: dict[str, Callable[[random.Random], Iterator[str]]] = {
    "technical": _log_lines,
    "billing": _invoice_lines,
    "account": _login_lines,
    "shipping": _tracking_lines,
    "other": lambda rng: _details(rng, "other"),
}


def _attachment(rng: random.Random, label: str, budget: int) -> str:
    if rng.random() < 0.35:
        return "\n".join(_take(rng, _email_thread(rng, label), budget))
    intro = rng.choice(A.ATTACH_INTROS[label])
    body = _take(rng, _BLOCKS[label](rng), budget - len(intro.split()), sentence=label == "other")
    joiner = " " if label == "other" else "\n"
    return intro + "\n" + joiner.join(body)


def compose_ticket(rng: random.Random, label: str, target_words: int) -> str:
    """Ticket text of exactly ``target_words`` words (whitespace-separated) for ``label``."""
    if target_words <= SHORT_MAX_WORDS:
        return _short(rng, label, target_words)
    greeting = _fill(rng.choice(P.GREETINGS), rng) if rng.random() < 0.55 else ""
    closing = ""
    if target_words >= 15 and rng.random() < 0.5:
        closing = _fill(rng.choice(P.CLOSINGS), rng)
        if rng.random() < 0.4:
            closing += "\n" + _fill(rng.choice(P.SIGNATURES), rng)
    room = target_words - len(greeting.split()) - len(closing.split())
    issue = ""
    for _ in range(4):  # prefer an issue sentence that fits whole
        issue = _fill(rng.choice(P.CATEGORIES[label]["issue"]), rng)
        if len(issue.split()) <= room:
            break
    if len(issue.split()) > room:  # too short for a full sentence: a terse fragment + a few words
        greeting = closing = ""
        issue = _pick_short(rng, P.CATEGORIES[label]["short"], 5)
        issue = issue[0].upper() + issue[1:] + "."
        room = target_words
    rest = room - len(issue.split())
    attach = ""
    if target_words >= ATTACH_MIN_WORDS and rest > 40 and rng.random() < 0.85:
        detail_words = min(rest - 30, rng.randint(8, 40))
        attach = _attachment(rng, label, rest - detail_words)
        rest = detail_words
    body = " ".join([issue] + _take(rng, _details(rng, label), rest))
    return "\n\n".join(p for p in (greeting, body, attach, closing) if p)


def iter_tickets(seed: int = 0) -> Iterator[dict[str, str]]:
    """Endless reproducible stream of ``{"id", "text", "label"}`` tickets."""
    rng = random.Random(seed)
    labels, weights = list(P.LABEL_WEIGHTS), list(P.LABEL_WEIGHTS.values())
    i = 0
    while True:
        label = rng.choices(labels, weights)[0]
        yield {"id": f"syn-{seed}-{i:06d}", "text": compose_ticket(rng, label, sample_length(rng)), "label": label}
        i += 1


def generate_tickets(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` synthetic tickets (``id``, ``text``, ``label`` = intended category), reproducible per seed."""
    if n < 0:
        raise ValueError("n must be >= 0")
    it = iter_tickets(seed)
    return [next(it) for _ in range(n)]


def word_count(text: str) -> int:
    """The length measure the quantiles are defined on."""
    return len(text.split())
