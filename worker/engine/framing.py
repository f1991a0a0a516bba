"""Tickets -> token rows: how one backbone sees a ticket, and ``prepare`` (the CPU half of a pass).

A ``Framing`` is one backbone's tokenizer, the ids its template puts around every ticket
(``[CLS]`` / ``[SEP]`` for an encoder, the answer cue for a causal LM) and how many ticket
tokens it takes. ``prepare`` tokenizes a window in one tokenizer call per backbone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from worker.engine.compat import text_config
from worker.engine.labels import LabelTokens
from worker.engine.loader import LoadedModel
from worker.engine.pieces import continuation_backend
from worker.engine.prompt import PromptTemplate
from worker.engine.types import ConfigError, InvalidTicket, Prepared, unicode_problem

Encode = Callable[[list[str]], list[list[int]]]


@dataclass(frozen=True)
class Framing:
    tokenizer: PreTrainedTokenizerBase
    template: PromptTemplate
    limit: int  # ticket tokens at most (the framing ids not counted)
    continuation: bool = False  # the ticket continues a prompt (a causal LM's row): no word-start marker (pieces.py)
    encode: Encode = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encode", ticket_encoder(self.tokenizer, self.continuation))

    @classmethod
    def of(cls, loaded: LoadedModel, template: PromptTemplate, max_input_tokens: int, reserve: int = 0) -> Framing:
        """An encoder takes at most its position limit less the special tokens around the ticket; a causal LM at
        most its positions less the prompt around the ticket and ``reserve`` (label tokens after it): a model with
        learned positions (GPT-2, OPT) fails on a row past them, any other was not trained there."""
        limit = max_input_tokens
        if loaded.kind == "encoder":
            specials = len(template.lead_ids) + len(template.tail_ids)
            limit = max(1, min(max_input_tokens, (loaded.max_length or max_input_tokens + specials) - specials))
        elif (positions := decoder_positions(text_config(loaded.model.config))) is not None:
            around = len(template.prefix_ids) + len(template.lead_ids) + len(template.tail_ids) + reserve
            if positions - around < 1:
                raise ConfigError(
                    f"the prompt takes {around} of the model's {positions} positions, leaving none for a ticket "
                    "(shorten the task: fewer or shorter examples and descriptions)",
                    setting="TRIAGE_TASK_FILE",
                )
            limit = min(max_input_tokens, positions - around)
        return cls(loaded.tokenizer, template, limit, continuation=loaded.kind == "decoder")

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @property
    def max_row(self) -> int:
        """The longest row a ticket can make: its ``limit`` tokens framed."""
        return len(self.template.lead_ids) + self.limit + len(self.template.tail_ids)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.encode(texts)

    def frame(self, ids: Sequence[int]) -> tuple[int, ...]:
        """The row of a ticket's ids: cut to ``limit``, framed by the template's lead and tail."""
        return self.template.lead_ids + tuple(ids[: self.limit]) + self.template.tail_ids


def label_room(loaded: LoadedModel, template: PromptTemplate, labels: Sequence[str], *, joined: bool) -> int:
    """Positions a causal LM's row leaves for the longest label's tokens after it (prompt scoring); none where
    labels are never scored as tokens (an encoder, joined features) or cannot be (the scorer says why)."""
    if loaded.kind != "decoder" or joined:
        return 0
    try:
        return LabelTokens.build(
            loaded.tokenizer, tuple(labels), template.label_lead, template.answer_end
        ).max_continuation
    except ValueError:
        return 0


def decoder_positions(config) -> int | None:
    """The most positions a causal LM's config declares (None: it declares none)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def ticket_encoder(tokenizer: PreTrainedTokenizerBase, continuation: bool = False) -> Encode:
    """Ticket texts -> ids, exactly as ``tokenizer(texts, add_special_tokens=False, split_special_tokens=True)``;
    with ``continuation`` as they continue a row (a SentencePiece-style tokenizer's word-start marker left out:
    ``pieces.continuation_backend``).

    ``split_special_tokens``: "<|im_end|>" typed in a ticket is plain text, never a control token.
    A fast tokenizer is called on a private copy of its Rust backend (no truncation, no padding,
    special tokens in the text encoded as text): transformers' per-ticket Python conversion was
    about half of a 4,096-ticket window's tokenizing here, holding the interpreter lock the pass
    thread needs, and the copy shares no settings that transformers flips per call with other
    callers of the tokenizer. Anything else goes through transformers.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_special_tokens"):
        return lambda texts: tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    own = (continuation_backend(backend) if continuation else None) or copy.deepcopy(backend)
    own.no_truncation()
    own.no_padding()
    own.encode_special_tokens = True
    batch = getattr(own, "encode_batch_fast", own.encode_batch)  # _fast: no offsets (tokenizers >= 0.21)
    return lambda texts: [e.ids for e in batch(texts, add_special_tokens=False)]


def prepare(
    texts: Sequence[str], lm: Framing, truncate: bool, aux: Framing | None = None
) -> list[Prepared | InvalidTicket]:
    """Tokenize tickets in one tokenizer call per backbone; bad ones come back as ``InvalidTicket``.

    A ticket over ``lm.limit`` tokens is cut, or refused when ``truncate`` is off. ``aux``: the
    encoder of joined features, whose row is cut to its own limit the same way (refused when ``truncate`` is off:
    it was cut whatever the setting)."""
    out: list[Prepared | InvalidTicket] = [InvalidTicket("ticket text is empty")] * len(texts)
    todo = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            out[i] = InvalidTicket(f"ticket text must be a string, got {type(t).__name__}")
        elif (why := unicode_problem(t, "ticket text")) is not None:  # else it fails the batch's tokenizer call
            out[i] = InvalidTicket(why)
        elif t.strip():
            todo.append(i)
    if not todo:
        return out
    batch = [texts[i] for i in todo]
    enc = lm.tokenize(batch)
    aux_enc = aux.tokenize(batch) if aux is not None else None
    limit = lm.limit
    for k, (i, ids) in enumerate(zip(todo, enc)):
        n = len(ids)
        if n == 0:  # an encoder's normalizer drops control and format characters: "\u200b" alone is no text
            out[i] = InvalidTicket("ticket text is empty (nothing the tokenizer keeps: control or format characters)")
            continue
        if n > limit and not truncate:
            out[i] = InvalidTicket(f"ticket is {n} tokens, over the {limit}-token limit (truncation is off)")
            continue
        aux_ids, aux_cut = (), False
        if aux is not None:
            aux_ids, aux_cut = aux.frame(aux_enc[k]), len(aux_enc[k]) > aux.limit
            if aux_cut and not truncate:
                out[i] = InvalidTicket(
                    f"ticket is {len(aux_enc[k])} tokens for the encoder, over its {aux.limit}-token limit "
                    "(truncation is off)"
                )
                continue
        out[i] = Prepared(
            ids=lm.frame(ids), n_text_tokens=min(n, limit), truncated=n > limit or aux_cut, aux_ids=aux_ids
        )
    return out
