"""The engine: tokenize -> plan length buckets -> one forward call per pass -> label probabilities.

Split like infinity's models: ``prepare`` (tokenize, CPU: ``framing``), ``run_pass``
(forward, device; ``launch`` holds a queued pass and its clocks), ``postprocess``
(softmax, threshold, a pass's cost: ``results``, no torch). The worker overlaps
``prepare`` of the next window with ``classify`` of the current one.

Everything a classifier does is fixed when it is built (``EngineOptions``,
scorer, score bias); ``with_scoring`` gives a new one on the same loaded model.
Assembly from the process settings lives in ``worker.assemble``.

Backbones: a causal LM (prompt prefix + prefix KV cache; label tokens or a head), a
bidirectional encoder (``[CLS] ticket [SEP]``, no prefix; a head), or both joined
(``encoder=``, see ``joined``: the LM and the encoder run on the same passes and a head
reads the LM's pooled states with the encoder's embedding appended).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from worker.engine import bucketing
from worker.engine.attention_setup import setup_attention
from worker.engine.compat import text_config
from worker.engine.device import dtype_name, pick_attention, sdpa_context
from worker.engine.encoder import run_encoder
from worker.engine.exactness import FastPaths, fast_paths
from worker.engine.forward import ForwardOut, PrefixKV, compute_prefix, run_forward
from worker.engine.framing import Framing, label_room, prepare
from worker.engine.joined import backbone_name as backbone_name
from worker.engine.joined import check_pair, join_encoder
from worker.engine.labels import LabelTokens
from worker.engine.launch import LaunchedPass, Prelaunched
from worker.engine.loader import LoadedModel
from worker.engine.pipeline import run_ahead
from worker.engine.prompt import PromptTemplate, build_template, encoder_template
from worker.engine.results import PassOutput, in_input_order, pass_cost, predictions, softmax
from worker.engine.results import decide as decide
from worker.engine.scoring import Scorer, default_scorer
from worker.engine.task import Task

# Re-exported (with softmax, decide, backbone_name): these used to live here and callers outside the
# engine may import them from here.
from worker.engine.types import EngineOptions, InvalidTicket, PassStats, Prediction, Prepared, RunStats

log = logging.getLogger("triage.engine")
_NO_LABELS = LabelTokens((), (), (), (), ())  # a head scores no label tokens: no continuation

__all__ = ["Classifier", "EngineOptions", "InvalidTicket", "PassStats", "Prediction", "Prepared", "RunStats", "softmax"]


class Classifier:
    """One task on one loaded model: ``prepare`` -> ``classify_passes`` / ``classify``.

    ``options`` (or keyword overrides of its fields, e.g. ``pass_max_items=8``) set the
    caps and limits; ``scorer`` defaults to label-token prompt scoring; ``score_bias``
    (per label, subtracted from the log-scores: calibration) defaults to none.
    ``encoder``: joined features (a second, encoder backbone on the same passes).
    ``head_prompt``: ``labels`` builds the prompt from the instructions and label names
    only (what a head reads best, docs/quality.md), ``task`` from the whole task.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        task: Task,
        options: EngineOptions | None = None,
        *,
        scorer: Scorer | None = None,
        score_bias: Sequence[float] | np.ndarray | None = None,
        encoder: LoadedModel | None = None,
        head_prompt: str = "task",
        **option_changes,
    ):
        check_pair(loaded, encoder)
        if head_prompt not in ("task", "labels"):
            raise ValueError(f"head_prompt must be 'task' or 'labels', got {head_prompt!r}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.kind = loaded.kind  # "decoder" | "encoder"
        self.encoder = encoder
        self.model_name = backbone_name(loaded, encoder)
        self.task = task
        self.options = dataclasses.replace(options or EngineOptions(), **option_changes)
        self.head_prompt = head_prompt if self.kind == "decoder" else None  # the prompt a head's states come from
        if self.kind == "encoder":
            self.template: PromptTemplate = encoder_template(self.tokenizer)
        else:
            self.template = build_template(self.tokenizer, task.labels_only() if head_prompt == "labels" else task)
        decoder = self.kind == "decoder"
        room = label_room(loaded, self.template, task.labels, joined=encoder is not None)
        self.framing = Framing.of(loaded, self.template, self.options.max_input_tokens, room)
        self.max_input_tokens, self.pad_id = self.framing.limit, self.framing.pad_id
        # joined features: how the encoder sees the same tickets
        self.aux_framing = (
            Framing.of(encoder, encoder_template(encoder.tokenizer), self.options.max_input_tokens)
            if encoder is not None
            else None
        )
        self._set_scoring(scorer, score_bias)
        # attention: "padded" (length buckets, SDPA, expanded prefix cache: CPU/MPS, and the reference) or
        # "packed" (one unpadded stream per pass, the prefix K/V shared through a log-sum-exp merge: CUDA)
        # the fast paths only where they are the model's own attention: rules read from the config (exactness: a
        # sliding window, soft-capped logits), then checks on the loaded model (attention_setup: a packed call)
        cfg, cont = text_config(self.model.config), getattr(self.scorer, "labels", _NO_LABELS).max_continuation
        self.fast_paths = fast_paths(cfg, self.prefix_length + self.framing.max_row + cont) if decoder else FastPaths()
        wanted = pick_attention(self.options.attention, self.model.device) if decoder else "padded"
        self.fast_paths, self.attention, self.attention_kernel = setup_attention(
            self.model, self.fast_paths, wanted, self.options.prefix_cache, self.options.attention_kernel, log
        )
        self._graphs = None  # graphs.GraphRunner, made on the first packed pass when CUDA graphs apply
        # classify_passes queues the next pass before yielding one (on CPU a launched pass has run: nothing overlaps)
        ahead = self.options.lookahead
        self.lookahead = ahead == "on" or (ahead == "auto" and self.model.device.type == "cuda")
        self._readback_at = 0.0  # when the last pass's scores reached the host: the next pass's wall starts there
        self._prefix: PrefixKV | None = None
        if self.use_prefix_cache:
            self._prefix = compute_prefix(self.model, self.template.prefix_ids)

    def with_scoring(
        self, scorer: Scorer | None = None, score_bias: Sequence[float] | np.ndarray | None = None
    ) -> Classifier:
        """A new classifier on the same model, task, options and prompt-prefix cache with another scorer / bias.

        ``None`` means what the constructor means: prompt scoring, no bias. This object is left as it is.
        """
        new = copy.copy(self)
        new._set_scoring(scorer, score_bias)
        return new

    def _set_scoring(self, scorer: Scorer | None, score_bias) -> None:
        if scorer is not None and tuple(scorer.names) != self.labels:
            raise ValueError(f"scorer labels {list(scorer.names)} != task labels {list(self.labels)}")
        self.scorer: Scorer = scorer or default_scorer(self)
        bias = np.zeros(len(self.labels)) if score_bias is None else np.asarray(score_bias, dtype=np.float64)
        if bias.shape != (len(self.labels),):
            raise ValueError(f"score_bias needs one value per label ({len(self.labels)}), got shape {bias.shape}")
        self.score_bias = bias  # calibration: subtracted from log-scores

    @property
    def labels(self) -> tuple[str, ...]:
        return self.task.labels

    @property
    def prefix_length(self) -> int:
        return len(self.template.prefix_ids)

    @property
    def needs_head(self) -> bool:
        """An encoder, or joined features: no label tokens to score, only a head can."""
        return self.kind != "decoder" or self.encoder is not None

    @property
    def use_prefix_cache(self) -> bool:
        """The prompt prefix's KV cache is on (never for an encoder: it is bidirectional, no prefix)."""
        return self._cached(None)

    @property
    def feature_blocks(self) -> tuple[int, ...]:
        """Widths of the pooled states per backbone: the LM's, then the encoder's (a head normalizes each)."""
        own = (self.model.config.hidden_size,)
        return own + ((self.encoder.model.config.hidden_size,) if self.encoder is not None else ())

    @property
    def feature_dim(self) -> int:
        return sum(self.feature_blocks)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.model.dtype)

    # --------------------------------------------------------------- tokenize
    def prepare(self, texts: Sequence[str]) -> list[Prepared | InvalidTicket]:
        """Tokenize tickets in one tokenizer call (per backbone); bad ones come back as ``InvalidTicket``."""
        return prepare(texts, self.framing, self.options.truncate, self.aux_framing)

    def prepare_valid(self, texts: Sequence[str]) -> list[Prepared]:
        """Like ``prepare`` but raises on the first invalid ticket."""
        items = self.prepare(texts)
        for i, p in enumerate(items):
            if isinstance(p, InvalidTicket):
                raise InvalidTicket(f"ticket {i}: {p}")
        return items  # type: ignore[return-value]

    # ------------------------------------------------------------------- plan
    def _cached(self, prefix_cache: bool | None) -> bool:
        wanted = self.options.prefix_cache if prefix_cache is None else prefix_cache
        return wanted and self.kind == "decoder" and not self.fast_paths.prefix_cache

    def _attention_of(self, attention: str | None) -> str:
        """The attention a pass runs: the one asked for, padded where packed is not this model's attention."""
        return "padded" if self.fast_paths.packed else attention or self.attention

    def cost_length(self, p: Prepared, prefix_cache: bool | None = None) -> int:
        """Tokens the forward call computes for this ticket (the prefix too when it is not cached;
        joined features: both models' tokens)."""
        return len(p.ids) + (0 if self._cached(prefix_cache) else self.prefix_length) + len(p.aux_ids)

    def plan(
        self, items: Sequence[Prepared], prefix_cache: bool | None = None, attention: str | None = None
    ) -> list[bucketing.Pass]:
        """Passes for ``items`` under this classifier's per-pass caps: packed (real tokens) or padded length buckets."""
        o = self.options
        lengths = [self.cost_length(p, prefix_cache) for p in items]
        if self._attention_of(attention) == "packed":
            return bucketing.plan_packed(lengths, o.pass_max_items, o.pass_max_tokens)
        return bucketing.plan_passes(lengths, o.pass_max_items, o.pass_max_tokens, o.pass_overhead_tokens)

    # ---------------------------------------------------------------- forward
    def run_pass(
        self,
        items: Sequence[Prepared],
        prefix_cache: bool | None = None,
        pad_to: int | None = None,
        attention: str | None = None,
    ) -> np.ndarray:
        """One forward call for ``items``; returns [B, J] log-scores.

        Padded: rows padded to their own longest (or ``pad_to``). Packed: one unpadded
        token stream (``pad_to`` does not apply). ``attention`` overrides the classifier's.
        """
        return self.launch_pass(items, prefix_cache, pad_to, attention).result()

    def launch_pass(
        self,
        items: Sequence[Prepared],
        prefix_cache: bool | None = None,
        pad_to: int | None = None,
        attention: str | None = None,
    ) -> LaunchedPass:
        """``run_pass`` without waiting: on CUDA the pass is queued on the device and its scores copied
        to pinned host memory asynchronously; ``.result()`` waits. Elsewhere it has run already."""
        timer = LaunchedPass(self.device)
        scores = self._scores(items, prefix_cache, pad_to, attention, timer.mark)
        return timer.finish_launch(scores)

    def _scores(
        self,
        items: Sequence[Prepared],
        prefix_cache: bool | None,
        pad_to: int | None,
        attention: str | None,
        on_device=None,
    ) -> torch.Tensor:
        """[B, J] float64 log-scores on the model's device (nothing waits for the device here on CUDA).

        ``on_device()`` is called once the host-side preparation is done, before the pass's first device work.
        """
        if len(items) > 1 and self.scorer.needs_cache and self.fast_paths.continuations_alone:
            first = self._scores(items[:1], prefix_cache, pad_to, attention, on_device)
            return torch.cat([first, *(self._scores([p], prefix_cache, pad_to, attention) for p in items[1:])])
        packed = self.kind == "decoder" and self._attention_of(attention) == "packed"
        with nullcontext() if packed else sdpa_context(self.model.device):
            fwd = self._forward(items, prefix_cache, pad_to, packed, on_device)
            return self.scorer.scores(self.model, self._join(fwd, items)).double()

    def _forward(
        self, items: Sequence[Prepared], prefix_cache: bool | None, pad_to: int | None, packed: bool, on_device
    ) -> ForwardOut:
        """The backbone's pooled states (and what the scorer keeps) for ``items``: one forward call."""
        if self.kind == "encoder":  # bidirectional: [CLS] ticket [SEP] rows, padded, no prefix
            return run_encoder(self.model, [p.ids for p in items], self.pad_id, pad_to, on_device=on_device)
        if self._cached(prefix_cache):
            if self._prefix is None:
                self._prefix = compute_prefix(self.model, self.template.prefix_ids)
            rows, prefix, pool_from = [p.ids for p in items], self._prefix, 0
        else:
            rows, prefix, pool_from = [self.template.prefix_ids + p.ids for p in items], None, self.prefix_length
        common = dict(
            keep_cache=self.scorer.needs_cache,
            mean_pool=self.scorer.needs_mean,
            pool_from=pool_from,
            on_device=on_device,
        )
        if packed:
            from worker.engine.packed import run_packed

            common.update(kernel=self.attention_kernel, runner=self.graph_runner())
            return run_packed(self.model, rows, self.pad_id, prefix, **common)
        return run_forward(self.model, rows, self.pad_id, prefix, pad_to=pad_to, **common)

    def _join(self, fwd: ForwardOut, items: Sequence[Prepared]) -> ForwardOut:
        """Joined features: the encoder on the same tickets (padded to its own longest), its states appended."""
        if self.encoder is None:
            return fwd
        return join_encoder(fwd, self.encoder, self.aux_framing.pad_id, items)

    def graph_stats(self) -> dict | None:
        """CUDA graph totals (``GraphRunner.stats``), also after graphs were turned off; None where none were made."""
        return self._graphs.stats() if self._graphs is not None else None

    def graph_runner(self):
        """The CUDA-graph runner of packed passes (CUDA, flash kernel, ``cuda_graphs`` on), else None."""
        if not (self.options.cuda_graphs and self.device.type == "cuda" and self.attention_kernel == "flash"):
            return None
        if self._graphs is None:
            from worker.engine.graphs import GraphRunner

            self._graphs = GraphRunner(self.model, self.pad_id)
        return self._graphs if self._graphs.enabled else None

    # ------------------------------------------------------------ postprocess
    def postprocess(self, log_scores: np.ndarray, items: Sequence[Prepared]) -> list[Prediction]:
        """[B, J] log-scores -> predictions: the score bias subtracted, then softmax and threshold."""
        o = self.options
        return predictions(log_scores - self.score_bias, items, self.labels, o.confidence_threshold, o.fallback_label)

    # ---------------------------------------------------------------- run all
    def classify_passes(
        self,
        items: Sequence[Prepared],
        passes: Sequence[bucketing.Pass] | None = None,
        *,
        prefix_cache: bool | None = None,
        pad_to: int | None = None,
        attention: str | None = None,
        first: Prelaunched | None = None,
        before_last: Callable[[Callable[[], bool]], None] | None = None,
    ) -> Iterator[PassOutput]:
        """Classify in length buckets (or the given ``passes``), yielding after every forward call.

        Yields ``(indices into items, their predictions, what the pass cost)``; a caller can write those results
        before the next pass runs. ``pad_to`` (a length in cost tokens, see ``cost_length``) pads every padded
        pass to one width (benchmark baselines). ``attention``: "padded" or "packed" (default: the classifier's).

        With ``lookahead`` (CUDA) the next pass is queued before a pass's results are read back and
        yielded, so the device never waits for the host's per-pass work (building the next token
        stream, softmax, the caller writing results): one pass in flight ahead. At the end,
        ``before_last(busy)`` is called with the last pass queued and not yet read back, ``busy()`` saying whether
        the device still works on it (the worker queues the next window's first pass there); ``first``: that
        pass, from ``prelaunch``, if it is ``passes[0]``.
        """
        cached = self._cached(prefix_cache)
        attention = self._attention_of(attention)
        if passes is None:
            passes = self.plan(items, cached, attention)
        settings, run = (cached, attention, pad_to), dict(prefix_cache=cached, pad_to=pad_to, attention=attention)
        yield from run_ahead(
            passes,
            lambda b: self.launch_pass([items[i] for i in b.indices], **run),
            lambda b, launched: self._complete(b, [items[i] for i in b.indices], launched, *settings),
            ahead=self.lookahead,
            adopt=(lambda b: first.take(b, settings)) if first is not None else None,
            before_last=(lambda launched: before_last(launched.busy)) if before_last is not None else None,
        )

    def prelaunch(self, items: Sequence[Prepared], passes: Sequence[bucketing.Pass]) -> Prelaunched:
        """Queue ``passes[0]`` now, behind what is on the device, as ``classify_passes(items, passes)`` would."""
        cached, attention = self._cached(None), self.attention
        b = passes[0]
        launched = self.launch_pass([items[i] for i in b.indices], prefix_cache=cached, attention=attention)
        return Prelaunched(b, launched, (cached, attention, None))

    def _complete(
        self, b: bucketing.Pass, chunk, launched: LaunchedPass, cached: bool, attention: str, pad_to: int | None
    ) -> PassOutput:
        log_scores = launched.result(since=self._readback_at)
        self._readback_at = launched.done_at
        t0 = time.perf_counter()
        preds = self.postprocess(log_scores, chunk)
        post_ms = (time.perf_counter() - t0) * 1000
        prefix_tokens = self.prefix_length if cached else 0
        stats = pass_cost(
            b, launched, post_ms, packed=attention == "packed", pad_to=pad_to, prefix_tokens=prefix_tokens
        )
        return b.indices, preds, stats

    def classify(
        self, items: Sequence[Prepared], passes: Sequence[bucketing.Pass] | None = None, **run
    ) -> tuple[list[Prediction], RunStats]:
        """All of ``classify_passes``, with its arguments (``run``: ``prefix_cache``, ``pad_to``, ``attention``):
        predictions in input order, and the passes' stats added up."""
        return in_input_order(self.classify_passes(items, passes, **run), len(items))

    def reference(self, items: Sequence[Prepared]) -> list[Prediction]:
        """Each ticket alone: no padding, no prefix cache, the model's own attention (padded path).

        The answer the fast path must match."""
        return [self.postprocess(self.run_pass([p], prefix_cache=False, attention="padded"), [p])[0] for p in items]

    def classify_texts(self, texts: Sequence[str]) -> list[Prediction]:
        return self.classify(self.prepare_valid(texts))[0]
