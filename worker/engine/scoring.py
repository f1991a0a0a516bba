"""Turn a forward pass into per-label log-scores.

``PromptScorer`` (constrained output): project each row's last hidden state onto
the label tokens' LM-head rows only; for labels with more tokens, add the exact
log-probs of the continuation tokens, computed with the KV cache in one extra
batched pass. The full-vocabulary normaliser of the first token is shared by all
labels and cancels in the softmax over labels, so it is never computed.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from worker.engine.compat import cache_kwarg
from worker.engine.forward import ForwardOut, decoder, padded_rows
from worker.engine.labels import LabelTokens


class Scorer(Protocol):
    kind: str  # "prompt", "head", ...: what the scores come from (logs, checks)
    names: tuple[str, ...]
    needs_cache: bool
    needs_mean: bool

    def scores(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        """[B, J] float32 log-scores (softmax over J gives label probabilities)."""


class PromptScorer:
    kind = "prompt"
    needs_mean = False

    def __init__(self, model: PreTrainedModel, labels: LabelTokens):
        self.labels = labels
        self.names = labels.names
        self.needs_cache = bool(labels.multi)
        head = model.get_output_embeddings()
        rows = torch.tensor(labels.first_ids, device=head.weight.device)
        self._w = head.weight.detach().index_select(0, rows).float()  # [U, H]
        bias = getattr(head, "bias", None)
        self._b = bias.detach().index_select(0, rows).float() if bias is not None else None

    @torch.inference_mode()
    def scores(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        first = fwd.h_last.float() @ self._w.T
        if self._b is not None:
            first = first + self._b
        out = first[:, list(self.labels.first_col)].clone()
        if self.labels.multi:
            out[:, list(self.labels.multi)] += self._continuations(model, fwd)
        return out

    def _continuations(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        """Sum of log p(label token k | context, label tokens < k) for k >= 1, for every multi-token label."""
        dev = fwd.h_last.device
        seqs = [self.labels.sequences[j] for j in self.labels.multi]
        if fwd.packed is not None:
            return self._continuations_packed(model, fwd, seqs)
        m, b = len(seqs), fwd.h_last.shape[0]
        inp, tgt, valid = _continuation_rows(seqs)
        width = inp.shape[1]
        # rows ordered (ticket i, label r): ticket-major
        rep = torch.arange(b, device=dev).repeat_interleave(m)
        cache = DynamicCache(
            ddp_cache_data=[
                (layer.keys.index_select(0, rep), layer.values.index_select(0, rep)) for layer in fwd.cache.layers
            ]
        )
        inp, tgt, valid = inp.to(dev).repeat(b, 1), tgt.to(dev).repeat(b, 1), valid.to(dev).repeat(b, 1)
        mask = torch.cat([fwd.attention_mask.index_select(0, rep), valid], dim=1)
        pos = fwd.next_pos.index_select(0, rep)[:, None] + torch.arange(width, device=dev)[None, :]
        dec = decoder(model)
        out = dec(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(dec): cache})
        logits = model.get_output_embeddings()(out.last_hidden_state).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        return (logp * valid).sum(-1).view(b, m)

    def _continuations_packed(self, model: PreTrainedModel, fwd: ForwardOut, seqs) -> torch.Tensor:
        """The same sums after a packed pass: one small packed call over every (ticket, label) continuation."""
        from worker.engine.packed import run_continuations

        hidden = run_continuations(model, fwd.packed, [s[:-1] for s in seqs])  # [B, M, W, H]
        b, m, width = hidden.shape[:3]
        _, tgt, valid = _continuation_rows(seqs)
        dev = hidden.device
        logits = model.get_output_embeddings()(hidden).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.to(dev).expand(b, m, width).unsqueeze(-1)).squeeze(-1)
        return (logp * valid.to(dev)).sum(-1)


def _continuation_rows(seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, W] inputs (label tokens but the last), targets (all but the first) and their mask, right-padded."""
    inp, _, valid = padded_rows([s[:-1] for s in seqs], 0)
    return inp, padded_rows([s[1:] for s in seqs], 0)[0], valid


class HeadRequired:
    """The scorer of a backbone without label tokens (an encoder, joined features) until a head is set."""

    kind = "none"
    needs_cache = False
    needs_mean = True

    def __init__(self, names: tuple[str, ...], why: str):
        self.names = names
        self.why = why

    def scores(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        raise RuntimeError(self.why)
