"""One batched forward pass of a bidirectional encoder (BERT family) over right-padded rows.

No prefix KV cache: every token attends to every other, so a shared prompt prefix
would change with each ticket. Rows are ``[CLS] ticket [SEP]``; padding is masked,
and absolute position ids start at 0 for every row, so a padded row gives the same
states as the row alone (``Classifier.reference`` checks it).
The pooled state is the attention-mask weighted mean over every real token, special
tokens included: what sentence-transformers' mean pooling computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from worker.engine.forward import ForwardOut, masked_mean, padded_rows
from worker.engine.transfer import upload


@torch.inference_mode()
def run_encoder(
    model: PreTrainedModel, rows: Sequence[Sequence[int]], pad_id: int, pad_to: int | None = None, on_device=None
) -> ForwardOut:
    """``h_mean``: mask-weighted mean (float32); ``h_last``: the state at each row's last real token ([SEP]).

    ``on_device()`` is called once the host tensors are built, before any device work (pass timing)."""
    dev = model.device
    ids, lens, mask = padded_rows(rows, pad_id, pad_to)
    if on_device is not None:
        on_device()
    ids, mask, lens_d = (upload(t, dev) for t in (ids, mask, lens))
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # token types default to 0
    h_mean = masked_mean(hidden, mask)
    h_last = hidden[torch.arange(len(rows), device=dev), lens_d - 1]
    return ForwardOut(h_last=h_last, h_mean=h_mean, cache=None, attention_mask=mask, next_pos=lens_d)
