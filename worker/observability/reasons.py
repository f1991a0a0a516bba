"""A short, stable class for a dead letter's reason sentence (a metric label, a status column).

The sentences are written for people and may change wording; the classes are
few and fixed, so a Prometheus label stays low-cardinality and dashboards keep
working. Pure: no Redis, no torch.
"""

from __future__ import annotations

# (class, substrings: any one of them marks the class). Order matters: first match wins.
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("poison", ("TRIAGE_MAX_DELIVERIES",)),
    ("deleted", ("deleted from the stream",)),
    ("model_error", ("the model failed",)),
    ("tokenizer_error", ("the tokenizer failed",)),
    ("too_many_tokens", ("-token limit",)),
    ("too_large", ("TRIAGE_MAX_TEXT_BYTES",)),
    ("not_utf8", ("not valid UTF-8", "not valid Unicode", "must be a string")),
    ("no_text", ("no 'text' field",)),
    ("empty_text", ("is empty (or only whitespace)", "ticket text is empty")),
    ("bad_meta", ("meta is not valid JSON", "meta must be a JSON object")),
    ("bad_id", ("id is empty", "id is longer than", "id contains control characters")),
    ("repeated_field", ("more than once",)),
    ("unreadable_job", ("RQ cannot read this job",)),  # the RQ batch worker's: a job hash RQ cannot restore
)

REASON_CLASSES: tuple[str, ...] = tuple(name for name, _ in _RULES) + ("other",)


def reason_class(reason: str | None) -> str:
    """One of ``REASON_CLASSES`` for a dead letter's ``reason`` field ("other" if none matches)."""
    text = reason or ""
    for name, needles in _RULES:
        if any(n in text for n in needles):
            return name
    return "other"
