"""Tokenizing text that continues a row: the ticket after the prompt, the answer cue after the ticket.

SentencePiece-style tokenizers (Llama 2, Mistral, Phi-3: a ``Metaspace`` pre-tokenizer, or a ``Prepend("▁")``
normalizer) mark the start of every text they are given as the start of a word. Tokenized on its own, a ticket
after "Ticket:\\n" began with a space ("▁refund" where the whole text gives "re", "fund") and the cue "\\nCategory:"
with a stray "▁" token: the model read " refund me \\nCategory:". A continuation is tokenized without that marker,
as it is inside the whole text. Byte-level tokenizers (Qwen, SmolLM2, Llama 3, GPT-2) have no such marker: for
them nothing changes.
"""

from __future__ import annotations

import json
from typing import Any

_SUBTREES = ("normalizer", "pre_tokenizer", "normalizers", "pretokenizers")  # never the decoder's Metaspace


def continuation_backend(backend: Any) -> Any | None:
    """A copy of a ``tokenizers.Tokenizer`` that puts no word-start marker before a text's first word, or None
    when ``backend`` puts none (nothing to change)."""
    from tokenizers import Tokenizer

    raw = json.loads(backend.to_str())
    changed = False
    for key in ("normalizer", "pre_tokenizer"):
        if raw.get(key) is not None:
            raw[key], hit = _no_marker(raw[key])
            changed = changed or hit
    return Tokenizer.from_str(json.dumps(raw)) if changed else None


def _no_marker(node: Any) -> tuple[Any, bool]:
    """``node`` (a normalizer or pre-tokenizer as JSON) without a word-start marker, and whether it had one."""
    if isinstance(node, list):
        kept, changed = [], False
        for item in node:
            if isinstance(item, dict) and item.get("type") == "Prepend" and item.get("prepend") == "\u2581":
                changed = True  # Llama 2's converted tokenizer.json: Prepend("▁") + Replace(" ", "▁")
                continue
            item, hit = _no_marker(item)
            kept.append(item)
            changed = changed or hit
        return kept, changed
    if not isinstance(node, dict):
        return node, False
    changed = False
    if node.get("type") == "Metaspace":
        if node.get("prepend_scheme", "never") != "never":
            node = {**node, "prepend_scheme": "never"}
            changed = True
        if node.get("add_prefix_space"):  # tokenizers < 0.19's spelling
            node = {**node, "add_prefix_space": False}
            changed = True
    for key in _SUBTREES:
        if key in node:
            node[key], hit = _no_marker(node[key])
            changed = changed or hit
    if node.get("type") == "Sequence" and node.get("normalizers") == []:
        return None, changed  # nothing left to normalize (a Sequence of none is refused by some versions)
    return node, changed


def encode_continuation(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text``'s ids where it continues a row (no word-start marker); special tokens in it stay special."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    own = continuation_backend(backend) if backend is not None and hasattr(backend, "to_str") else None
    if own is None:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    own.no_truncation()
    own.no_padding()
    return tuple(own.encode(text, add_special_tokens=False).ids)
