"""Label names -> answer token sequences, for constrained scoring.

Single-token labels are scored from one projection of the last hidden state onto
their LM-head rows. Labels that share a first token or span several tokens are
scored exactly as the sum of their token log-probs (continuations use the KV
cache), never rejected.

When one label's tokens begin another's ("account" and "account closure"), the
shorter would always win (p(a, b) = p(a) p(b | a) <= p(a)), so every label is then
scored as a complete answer: its tokens and the token that ends an answer in the
prompt's format (the end of an assistant turn, or a newline).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class LabelTokens:
    names: tuple[str, ...]
    sequences: tuple[tuple[int, ...], ...]
    first_ids: tuple[int, ...]  # distinct first tokens, the LM-head rows to project onto
    first_col: tuple[int, ...]  # per label: its column in first_ids
    multi: tuple[int, ...]  # labels needing continuation tokens
    ended: bool = False  # every sequence ends with the answer's end token (one label's tokens begin another's)

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, names: tuple[str, ...], lead: str, end: str = "") -> LabelTokens:
        enc = lambda s: tuple(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        seqs = tuple(enc(lead + n) for n in names)
        for n, s in zip(names, seqs):
            if not s:
                raise ValueError(f"label {n!r} tokenizes to nothing")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"two labels tokenize identically: {dict(zip(names, seqs))}")
        pair = _prefix_pair(names, seqs)
        ended = pair is not None
        if ended:
            if not enc(end):
                raise ValueError(
                    f"label {pair[0]!r} begins label {pair[1]!r} in tokens, and this prompt has no end-of-answer "
                    "token to tell them apart: rename one of them"
                )
            seqs = tuple(s + (_end_token(enc, lead + n, s, end),) for n, s in zip(names, seqs))
        first_ids: list[int] = []
        for s in seqs:
            if s[0] not in first_ids:
                first_ids.append(s[0])
        return cls(
            names=tuple(names),
            sequences=seqs,
            first_ids=tuple(first_ids),
            first_col=tuple(first_ids.index(s[0]) for s in seqs),
            multi=tuple(j for j, s in enumerate(seqs) if len(s) > 1),
            ended=ended,
        )

    @property
    def max_continuation(self) -> int:
        return max((len(self.sequences[j]) - 1 for j in self.multi), default=0)


def _prefix_pair(names: tuple[str, ...], seqs: tuple[tuple[int, ...], ...]) -> tuple[str, str] | None:
    """Two labels where the first's tokens begin the second's, if any."""
    for a, sa in zip(names, seqs):
        for b, sb in zip(names, seqs):
            if len(sa) < len(sb) and sb[: len(sa)] == sa:
                return a, b
    return None


def _end_token(enc, answer: str, seq: tuple[int, ...], end: str) -> int:
    """The token that ends ``answer`` as the prompt writes it (answer and end tokenized together, as in few-shot
    turns); the end's own first token where the two merge across the boundary."""
    joint = enc(answer + end)
    if len(joint) > len(seq) and joint[: len(seq)] == seq:
        return joint[len(seq)]
    return enc(end)[0]
