"""Label names -> answer token sequences, for constrained scoring.

Single-token labels are scored from one projection of the last hidden state onto
their LM-head rows. Labels that share a first token or span several tokens are
scored exactly as the sum of their token log-probs (continuations use the KV
cache), never rejected.
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

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, names: tuple[str, ...], lead: str) -> LabelTokens:
        seqs = tuple(tuple(tokenizer(lead + n, add_special_tokens=False)["input_ids"]) for n in names)
        for n, s in zip(names, seqs):
            if not s:
                raise ValueError(f"label {n!r} tokenizes to nothing")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"two labels tokenize identically: {dict(zip(names, seqs))}")
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
        )

    @property
    def max_continuation(self) -> int:
        return max((len(self.sequences[j]) - 1 for j in self.multi), default=0)
