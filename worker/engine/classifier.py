"""The engine: tokenize -> plan length buckets -> one forward per bucket -> label probabilities.

Split like infinity's models: ``prepare`` (tokenize, CPU), ``run_batch``
(forward, device), ``postprocess`` (softmax, threshold). The worker overlaps
``prepare`` of the next window with ``classify`` of the current one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from worker.engine import bucketing
from worker.engine.device import dtype_name, pick_device, pick_dtype
from worker.engine.encoder import run_encoder
from worker.engine.forward import ForwardOut, PrefixKV, compute_prefix, run_forward
from worker.engine.labels import LabelTokens
from worker.engine.loader import LoadedModel, load_model
from worker.engine.prompt import PromptTemplate, build_template, encoder_template
from worker.engine.scoring import HeadRequired, PromptScorer, Scorer
from worker.engine.task import Task, task_from_settings


class InvalidTicket(ValueError):
    """A ticket the engine cannot classify; the message is a sentence for a person."""


@dataclass(frozen=True)
class Prepared:
    ids: tuple[int, ...]  # suffix: ticket text tokens + answer cue ([CLS] text [SEP] for an encoder)
    n_text_tokens: int
    truncated: bool
    aux_ids: tuple[int, ...] = ()  # joined features: the same ticket as the encoder's [CLS] text [SEP]


@dataclass(frozen=True)
class Prediction:
    label: str
    scores: dict[str, float]  # label -> probability
    truncated: bool
    n_tokens: int

    @property
    def score(self) -> float:
        return max(self.scores.values())


@dataclass
class RunStats:
    items: int = 0
    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prefix_tokens_reused: int = 0
    infer_ms: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def padding_pct(self) -> float:
        return bucketing.PaddingStats(self.real_tokens, self.padded_tokens).padding_pct

    def merge(self, other: "RunStats") -> None:
        """Add another run's batch counters (not ``items``) into this one."""
        self.batches += other.batches
        self.real_tokens += other.real_tokens
        self.padded_tokens += other.padded_tokens
        self.prefix_tokens_reused += other.prefix_tokens_reused
        self.infer_ms += other.infer_ms
        self.batch_sizes.extend(other.batch_sizes)


class Classifier:
    def __init__(
        self,
        loaded: LoadedModel,
        task: Task,
        *,
        max_input_tokens: int = 512,
        truncate: bool = True,
        prefix_cache: bool = True,
        max_batch_items: int = 64,
        max_batch_tokens: int = 8192,
        batch_overhead_tokens: int = 32,
        scorer: Scorer | None = None,
        confidence_threshold: float = 0.0,
        fallback_label: str = "needs_review",
        encoder: LoadedModel | None = None,
        head_prompt: str = "task",
    ):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.kind = loaded.kind  # "decoder" | "encoder"
        self.encoder = encoder  # joined features: a second (encoder) backbone run on the same passes
        if encoder is not None and (loaded.kind != "decoder" or encoder.kind != "encoder"):
            raise ValueError(f"joined features need a causal LM plus an encoder, got {loaded.kind} + {encoder.kind}")
        self.model_name = loaded.name + (f"+{encoder.name}" if encoder is not None else "")
        self.task = task
        self.head_prompt = head_prompt if self.kind == "decoder" else None  # "task" | "labels": the prompt the states come from
        self.max_input_tokens = _fit_length(max_input_tokens, loaded, 2) if self.kind == "encoder" else max_input_tokens
        self.truncate = truncate
        self.use_prefix_cache = prefix_cache and self.kind == "decoder"  # bidirectional: no prefix to cache
        self.max_batch_items = max_batch_items
        self.max_batch_tokens = max_batch_tokens
        self.batch_overhead_tokens = batch_overhead_tokens
        self.confidence_threshold = confidence_threshold
        self.fallback_label = fallback_label
        if self.kind == "encoder":
            self.template: PromptTemplate = encoder_template(self.tokenizer)
        else:
            self.template = build_template(self.tokenizer, task.labels_only() if head_prompt == "labels" else task)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if encoder is not None:
            self.aux_template = encoder_template(encoder.tokenizer)
            self.aux_max_tokens = _fit_length(max_input_tokens, encoder, len(self.aux_template.lead_ids) + len(self.aux_template.tail_ids))
            self.aux_pad_id = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else 0
        if scorer is None and (self.kind == "encoder" or encoder is not None):
            scorer = HeadRequired(task.labels, f"{self.model_name} has no label tokens to score: it needs a head "
                                  "(TRIAGE_HEAD_PATH from `triage-worker fit`, or task examples for every label)")
        self.scorer: Scorer = scorer or PromptScorer(self.model, LabelTokens.build(self.tokenizer, task.labels, self.template.label_lead))
        self.score_bias = np.zeros(len(task.labels), dtype=np.float64)  # calibration: subtracted from log-scores
        self._prefix: PrefixKV | None = compute_prefix(self.model, self.template.prefix_ids) if self.use_prefix_cache else None

    # ------------------------------------------------------------------ build
    @classmethod
    def from_settings(cls, settings, task: Task | None = None) -> "Classifier":
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        device = pick_device(settings.device)
        dtype = pick_dtype(device, settings.dtype)
        loaded = load_model(settings.model, device, dtype, settings.cache_dir)
        encoder = load_model(settings.encoder, device, dtype, settings.cache_dir) if getattr(settings, "encoder", None) else None
        task = task or task_from_settings(settings)
        from worker.engine.configure import planned_scorer  # head / calibration (optional features)

        head = planned_scorer(settings, task, loaded.kind, loaded.name + (f"+{encoder.name}" if encoder else "")) == "head"
        clf = cls(
            loaded,
            task,
            encoder=encoder,
            head_prompt=getattr(settings, "head_prompt", "task") if head else "task",
            max_input_tokens=settings.max_input_tokens,
            truncate=settings.truncate,
            prefix_cache=settings.prefix_cache,
            max_batch_items=settings.max_batch_items,
            max_batch_tokens=settings.max_batch_tokens,
            batch_overhead_tokens=settings.batch_overhead_tokens,
            confidence_threshold=settings.confidence_threshold,
            fallback_label=settings.fallback_label,
        )
        from worker.engine.configure import apply_scoring_settings

        apply_scoring_settings(clf, settings)
        return clf

    @property
    def labels(self) -> tuple[str, ...]:
        return self.task.labels

    @property
    def prefix_length(self) -> int:
        return len(self.template.prefix_ids)

    @property
    def feature_dim(self) -> int:
        """Width of the pooled states a head sees (joined: the LM's, then the encoder's)."""
        return self.model.config.hidden_size + (self.encoder.model.config.hidden_size if self.encoder is not None else 0)

    @property
    def feature_blocks(self) -> tuple[int, ...]:
        """Widths of the pooled states per backbone (a head normalizes each block on its own)."""
        own = (self.model.config.hidden_size,)
        return own + ((self.encoder.model.config.hidden_size,) if self.encoder is not None else ())

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.model.dtype)

    # --------------------------------------------------------------- tokenize
    def prepare(self, texts: Sequence[str]) -> list[Prepared | InvalidTicket]:
        """Tokenize tickets in one tokenizer call; bad ones come back as ``InvalidTicket``."""
        out: list[Prepared | InvalidTicket] = [InvalidTicket("ticket text is empty")] * len(texts)
        todo = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                out[i] = InvalidTicket(f"ticket text must be a string, got {type(t).__name__}")
        if not todo:
            return out
        enc = self.tokenizer([texts[i] for i in todo], add_special_tokens=False)["input_ids"]
        aux = (self.encoder.tokenizer([texts[i] for i in todo], add_special_tokens=False)["input_ids"]
               if self.encoder is not None else [()] * len(todo))
        lead, tail = self.template.lead_ids, self.template.tail_ids
        for i, ids, aux_ids in zip(todo, enc, aux):
            n = len(ids)
            if n > self.max_input_tokens:
                if not self.truncate:
                    out[i] = InvalidTicket(
                        f"ticket is {n} tokens, over the {self.max_input_tokens}-token limit (truncation is off)"
                    )
                    continue
                ids = ids[: self.max_input_tokens]
            aux_row = ()
            if self.encoder is not None:
                t = self.aux_template
                aux_row = t.lead_ids + tuple(aux_ids[: self.aux_max_tokens]) + t.tail_ids
            out[i] = Prepared(ids=lead + tuple(ids) + tail, n_text_tokens=min(n, self.max_input_tokens),
                              truncated=n > self.max_input_tokens or len(aux_ids) > getattr(self, "aux_max_tokens", len(aux_ids)),
                              aux_ids=aux_row)
        return out

    def prepare_valid(self, texts: Sequence[str]) -> list[Prepared]:
        """Like ``prepare`` but raises on the first invalid ticket."""
        items = self.prepare(texts)
        for i, p in enumerate(items):
            if isinstance(p, InvalidTicket):
                raise InvalidTicket(f"ticket {i}: {p}")
        return items  # type: ignore[return-value]

    # ------------------------------------------------------------------- plan
    def cost_length(self, p: Prepared, prefix_cache: bool | None = None) -> int:
        """Tokens the forward pass computes for this ticket (the prefix too when it is not cached)."""
        cached = self.use_prefix_cache if prefix_cache is None else prefix_cache
        return len(p.ids) + (0 if cached else self.prefix_length) + len(p.aux_ids)

    def plan(self, items: Sequence[Prepared], prefix_cache: bool | None = None) -> list[bucketing.Batch]:
        """Length buckets for ``items`` under this classifier's batch caps."""
        return bucketing.plan_batches(
            [self.cost_length(p, prefix_cache) for p in items],
            self.max_batch_items,
            self.max_batch_tokens,
            self.batch_overhead_tokens,
        )

    # ---------------------------------------------------------------- forward
    def run_batch(self, items: Sequence[Prepared], prefix_cache: bool | None = None, pad_to: int | None = None) -> np.ndarray:
        """One forward pass for ``items`` (padded to their own longest, or ``pad_to``); returns [B, J] log-scores."""
        if self.kind == "encoder":
            fwd = run_encoder(self.model, [p.ids for p in items], self.pad_id, pad_to)
            return self.scorer.scores(self.model, fwd).double().cpu().numpy()
        cached = (self.use_prefix_cache if prefix_cache is None else prefix_cache) and self.kind == "decoder"
        if cached and self._prefix is None:
            self._prefix = compute_prefix(self.model, self.template.prefix_ids)
        if cached:
            rows, prefix, pool_from = [p.ids for p in items], self._prefix, 0
        else:
            rows, prefix, pool_from = [self.template.prefix_ids + p.ids for p in items], None, self.prefix_length
        fwd = run_forward(
            self.model,
            rows,
            self.pad_id,
            prefix,
            keep_cache=self.scorer.needs_cache,
            mean_pool=self.scorer.needs_mean,
            pool_from=pool_from,
            pad_to=pad_to,
        )
        if self.encoder is not None:
            fwd = _joined(fwd, run_encoder(self.encoder.model, [p.aux_ids for p in items], self.aux_pad_id))
        return self.scorer.scores(self.model, fwd).double().cpu().numpy()

    # ------------------------------------------------------------ postprocess
    def postprocess(self, log_scores: np.ndarray, items: Sequence[Prepared]) -> list[Prediction]:
        probs = softmax(log_scores - self.score_bias)
        preds = []
        for row, p in zip(probs, items):
            k = int(row.argmax())
            label = self.labels[k]
            if row[k] < self.confidence_threshold:
                label = self.fallback_label
            preds.append(
                Prediction(label=label, scores={n: float(x) for n, x in zip(self.labels, row)}, truncated=p.truncated, n_tokens=p.n_text_tokens)
            )
        return preds

    # ---------------------------------------------------------------- run all
    def classify(
        self,
        items: Sequence[Prepared],
        batches: Sequence[bucketing.Batch] | None = None,
        prefix_cache: bool | None = None,
        pad_to: int | None = None,
    ) -> tuple[list[Prediction], RunStats]:
        """Classify in length buckets (or the given batches); predictions come back in input order.

        ``pad_to`` (a length in cost tokens, see ``cost_length``) pads every batch to one width.
        """
        cached = self.use_prefix_cache if prefix_cache is None else prefix_cache
        if batches is None:
            batches = self.plan(items, cached)
        scores = np.zeros((len(items), len(self.labels)))
        stats = RunStats(items=len(items))
        t0 = time.perf_counter()
        for b in batches:
            chunk = [items[i] for i in b.indices]
            scores[list(b.indices)] = self.run_batch(chunk, prefix_cache=cached, pad_to=pad_to)
            stats.batches += 1
            stats.batch_sizes.append(b.size)
            stats.real_tokens += b.real_tokens
            stats.padded_tokens += b.size * max(b.max_len, pad_to or 0)
            stats.prefix_tokens_reused += self.prefix_length * b.size if cached else 0
        stats.infer_ms = (time.perf_counter() - t0) * 1000
        return self.postprocess(scores, items), stats

    def reference(self, items: Sequence[Prepared]) -> list[Prediction]:
        """Each ticket alone: no padding, no prefix cache. The answer the fast path must match."""
        return [self.postprocess(self.run_batch([p], prefix_cache=False), [p])[0] for p in items]

    def classify_texts(self, texts: Sequence[str]) -> list[Prediction]:
        return self.classify(self.prepare_valid(texts))[0]


def _fit_length(max_input_tokens: int, loaded: LoadedModel, specials: int) -> int:
    """Ticket tokens an encoder can take: its position limit less its special tokens."""
    return max(1, min(max_input_tokens, (loaded.max_length or max_input_tokens + specials) - specials))


def _joined(lm: ForwardOut, enc: ForwardOut) -> ForwardOut:
    """The LM's pooled states with the encoder's appended (float32); the LM's cache and positions kept."""
    return ForwardOut(
        h_last=torch.cat([lm.h_last.float(), enc.h_last.float()], dim=1),
        h_mean=torch.cat([lm.h_mean.float(), enc.h_mean.float()], dim=1) if lm.h_mean is not None else None,
        cache=lm.cache, attention_mask=lm.attention_mask, next_pos=lm.next_pos,
    )


def softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)
