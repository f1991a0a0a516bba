"""Joined features: a causal LM and a bidirectional encoder run on the same passes, one head reading both.

Kept out of ``classifier.py`` because only this optional mode needs it: which pairs may join,
the name a pair carries (results, logs and heads), and how the encoder's states join the LM's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engine.device import sdpa_context
from worker.engine.encoder import run_encoder
from worker.engine.forward import ForwardOut
from worker.engine.loader import LoadedModel
from worker.engine.types import Prepared


def check_pair(loaded: LoadedModel, encoder: LoadedModel | None) -> None:
    """Joined features need the LM first and the encoder second (no encoder: nothing to check)."""
    if encoder is not None and (loaded.kind != "decoder" or encoder.kind != "encoder"):
        raise ValueError(f"joined features need a causal LM plus an encoder, got {loaded.kind} + {encoder.kind}")


def backbone_name(loaded: LoadedModel, encoder: LoadedModel | None = None) -> str:
    """The model name results, logs and heads carry: the model's, then ``+`` the joined encoder's."""
    return loaded.name + (f"+{encoder.name}" if encoder is not None else "")


def join_encoder(lm: ForwardOut, encoder: LoadedModel, pad_id: int, items: Sequence[Prepared]) -> ForwardOut:
    """The encoder on the same tickets (their ``aux_ids``, padded to its own longest), its states appended."""
    with sdpa_context(encoder.model.device):
        return joined(lm, run_encoder(encoder.model, [p.aux_ids for p in items], pad_id))


def joined(lm: ForwardOut, enc: ForwardOut) -> ForwardOut:
    """The LM's pooled states with the encoder's appended (float32); the LM's cache and positions kept."""
    return ForwardOut(
        h_last=torch.cat([lm.h_last.float(), enc.h_last.float()], dim=1),
        h_mean=torch.cat([lm.h_mean.float(), enc.h_mean.float()], dim=1) if lm.h_mean is not None else None,
        cache=lm.cache,
        attention_mask=lm.attention_mask,
        next_pos=lm.next_pos,
    )
