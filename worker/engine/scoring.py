"""Turn a forward pass into per-label log-scores.

``PromptScorer`` (constrained output): project each row's last hidden state onto
the label tokens' LM-head rows only; for labels with more tokens, add the exact
log-probs of the continuation tokens, computed with the KV cache in one extra
batched pass. The full-vocabulary normaliser of the first token is shared by all
labels and cancels in the softmax over labels, so it is never computed.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from worker.engine.compat import cache_kwarg
from worker.engine.final_logits import Transform, final_step
from worker.engine.forward import ForwardOut, decoder, padded_rows
from worker.engine.labels import LabelTokens

# float32 logits per chunk of ``token_logprobs`` (256 MiB: ~440 positions of a 152k-token vocabulary)
LOGITS_BYTES = 1 << 28

log = logging.getLogger("triage.engine")


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
        self._final, problem = final_step(model)  # the model's own last step after its LM head
        if problem:
            log.warning("label scores may not be the model's own: its logits and the LM head's output %s", problem)
        head = model.get_output_embeddings()
        rows = torch.tensor(labels.first_ids, device=head.weight.device)
        self._w = head.weight.detach().index_select(0, rows).float()  # [U, H]
        bias = getattr(head, "bias", None)
        self._b = bias.detach().index_select(0, rows).float() if bias is not None else None
        # index tensors on the device once: a Python list as an index is a blocking host-to-device copy per pass
        dev = head.weight.device
        self._first_col = torch.tensor(labels.first_col, dtype=torch.long, device=dev)
        self._multi = torch.tensor(labels.multi, dtype=torch.long, device=dev)
        # continuations of the multi-token labels: inputs (host lists), targets and mask [M, W] (device)
        seqs = [labels.sequences[j] for j in labels.multi]
        self._inputs = [s[:-1] for s in seqs]
        self._cont_rows = tuple(t.to(dev) for t in _continuation_rows(seqs)) if seqs else None

    @torch.inference_mode()
    def scores(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        first = fwd.h_last.float() @ self._w.T
        if self._b is not None:
            first = first + self._b
        if self._final is not None:
            first = self._final(first)
        out = first.index_select(1, self._first_col)
        if self.labels.multi:
            out.index_add_(1, self._multi, self._continuations(model, fwd))
        return out

    def _continuations(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        """Sum of log p(label token k | context, label tokens < k) for k >= 1, for every multi-token label."""
        dev = fwd.h_last.device
        if fwd.packed is not None:
            return self._continuations_packed(model, fwd)
        m, b = len(self._inputs), fwd.h_last.shape[0]
        inp, tgt, valid = self._cont_rows
        width = inp.shape[1]
        # rows ordered (ticket i, label r): ticket-major
        rep = torch.arange(b, device=dev).repeat_interleave(m)
        cache = DynamicCache(
            ddp_cache_data=[
                (layer.keys.index_select(0, rep), layer.values.index_select(0, rep)) for layer in fwd.cache.layers
            ]
        )
        inp, tgt, valid = inp.repeat(b, 1), tgt.repeat(b, 1), valid.repeat(b, 1)
        mask = torch.cat([fwd.attention_mask.index_select(0, rep), valid], dim=1)
        pos = fwd.next_pos.index_select(0, rep)[:, None] + torch.arange(width, device=dev)[None, :]
        dec = decoder(model)
        out = dec(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(dec): cache})
        logp = token_logprobs(model, out.last_hidden_state, tgt, self._final)
        return (logp * valid).sum(-1).view(b, m)

    def _continuations_packed(self, model: PreTrainedModel, fwd: ForwardOut) -> torch.Tensor:
        """The same sums after a packed pass: one small packed call over every (ticket, label) continuation."""
        from worker.engine.packed import run_continuations

        hidden = run_continuations(model, fwd.packed, self._inputs)  # [B, M, W, H]
        _, tgt, valid = self._cont_rows
        logp = token_logprobs(model, hidden, tgt.expand(hidden.shape[:3]), self._final)
        return (logp * valid).sum(-1)


def token_logprobs(
    model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor, final: Transform | None = None
) -> torch.Tensor:
    """log p(target | hidden state) at every position ([..., H] states, [...] targets), in float32; ``final``:
    the model's own step after its LM head (``final_logits``).

    The full-vocabulary normaliser is computed a chunk of positions at a time, at most ``LOGITS_BYTES`` of float32
    logits each: 2,048 tickets x a few multi-token labels x Qwen's 152k-token vocabulary would be tens of GB at once.
    """
    head = model.get_output_embeddings()
    flat, tgt = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1, 1)
    step = max(1, LOGITS_BYTES // (4 * head.weight.shape[0]))
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for s in range(0, flat.shape[0], step):
        logits = head(flat[s : s + step]).float()
        if final is not None:
            logits = final(logits)
        out[s : s + step] = (logits.gather(-1, tgt[s : s + step]) - torch.logsumexp(logits, -1, keepdim=True))[:, 0]
    return out.view(targets.shape)


def _continuation_rows(seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, W] inputs (label tokens but the last), targets (all but the first) and their mask, right-padded."""
    inp, _, valid = padded_rows([s[:-1] for s in seqs], 0)
    return inp, padded_rows([s[1:] for s in seqs], 0)[0], valid


def default_scorer(clf) -> Scorer:
    """What a classifier scores with when given no scorer: its label tokens, or (an encoder, joined features: no
    label tokens) a placeholder that says a head is needed."""
    if clf.needs_head:
        return HeadRequired(
            clf.labels,
            f"{clf.model_name} has no label tokens to score: it needs a head "
            "(TRIAGE_HEAD_PATH from `triage-worker fit`, or task examples for every label)",
        )
    t = clf.template
    return PromptScorer(clf.model, LabelTokens.build(clf.tokenizer, clf.labels, t.label_lead, t.answer_end))


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
