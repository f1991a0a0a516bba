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
from worker.engine.device import dtype_name, pick_device, pick_dtype, pick_threads
from worker.engine.forward import PrefixKV, compute_prefix, run_forward
from worker.engine.labels import LabelTokens
from worker.engine.loader import LoadedModel, load_model
from worker.engine.prompt import PromptTemplate, build_template
from worker.engine.scoring import PromptScorer, Scorer
from worker.engine.task import Task, task_from_settings


class InvalidTicket(ValueError):
    """A ticket the engine cannot classify; the message is a sentence for a person."""


@dataclass(frozen=True)
class Prepared:
    ids: tuple[int, ...]  # suffix: ticket text tokens + answer cue
    n_text_tokens: int
    truncated: bool


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
    ):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.task = task
        self.max_input_tokens = max_input_tokens
        self.truncate = truncate
        self.use_prefix_cache = prefix_cache
        self.max_batch_items = max_batch_items
        self.max_batch_tokens = max_batch_tokens
        self.batch_overhead_tokens = batch_overhead_tokens
        self.confidence_threshold = confidence_threshold
        self.fallback_label = fallback_label
        self.template: PromptTemplate = build_template(self.tokenizer, task)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.scorer: Scorer = scorer or PromptScorer(self.model, LabelTokens.build(self.tokenizer, task.labels, self.template.label_lead))
        self.score_bias = np.zeros(len(task.labels), dtype=np.float64)  # calibration: subtracted from log-scores
        self._prefix: PrefixKV | None = compute_prefix(self.model, self.template.prefix_ids) if prefix_cache else None

    # ------------------------------------------------------------------ build
    @classmethod
    def from_settings(cls, settings, task: Task | None = None) -> "Classifier":
        device = pick_device(settings.device)
        if (threads := pick_threads(settings.torch_threads, device)) is not None:  # before the dtype probe
            torch.set_num_threads(threads)
        dtype = pick_dtype(device, settings.dtype)
        loaded = load_model(settings.model, device, dtype, settings.cache_dir)
        clf = cls(
            loaded,
            task or task_from_settings(settings),
            max_input_tokens=settings.max_input_tokens,
            truncate=settings.truncate,
            prefix_cache=settings.prefix_cache,
            max_batch_items=settings.max_batch_items,
            max_batch_tokens=settings.max_batch_tokens,
            batch_overhead_tokens=settings.batch_overhead_tokens,
            confidence_threshold=settings.confidence_threshold,
            fallback_label=settings.fallback_label,
        )
        from worker.engine.configure import apply_scoring_settings  # head / calibration (optional features)

        apply_scoring_settings(clf, settings)
        return clf

    @property
    def labels(self) -> tuple[str, ...]:
        return self.task.labels

    @property
    def prefix_length(self) -> int:
        return len(self.template.prefix_ids)

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
        # split_special_tokens: "<|im_end|>" typed in a ticket is plain text, never a control token
        enc = self.tokenizer([texts[i] for i in todo], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        tail = self.template.tail_ids
        for i, ids in zip(todo, enc):
            n = len(ids)
            if n > self.max_input_tokens:
                if not self.truncate:
                    out[i] = InvalidTicket(
                        f"ticket is {n} tokens, over the {self.max_input_tokens}-token limit (truncation is off)"
                    )
                    continue
                ids = ids[: self.max_input_tokens]
            out[i] = Prepared(ids=tuple(ids) + tail, n_text_tokens=min(n, self.max_input_tokens), truncated=n > self.max_input_tokens)
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
        return len(p.ids) + (0 if cached else self.prefix_length)

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
        cached = self.use_prefix_cache if prefix_cache is None else prefix_cache
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


def softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)
