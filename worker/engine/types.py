"""What goes into and comes out of the engine, and what one run of it cost. Pure: no torch, no numpy.

Kept apart from ``classifier.py`` so that the stream side (records, metrics, the
reader) can name these types without loading torch and transformers.

Words: a *pass* is one forward call over a length bucket; a *run* is the passes
one ``Classifier.classify`` call makes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """Settings that cannot work together (a scorer the model cannot run, a head fitted for another prompt):
    the operator's to fix, so every command says it in one line and exits 2 instead of a traceback. ``setting``:
    the variable to change, where one is known (the worker's ``config_invalid`` line names it)."""

    setting: str | None = None

    def __init__(self, *args: object, setting: str | None = None):
        super().__init__(*args)
        if setting is not None:
            self.setting = setting


class InvalidTicket(ValueError):
    """A ticket the engine cannot classify; the message is a sentence for a person."""


@dataclass(frozen=True)
class Prepared:
    """A tokenized ticket, ready for a pass."""

    ids: tuple[int, ...]  # suffix: ticket text tokens + answer cue ([CLS] text [SEP] for an encoder)
    n_text_tokens: int
    truncated: bool
    aux_ids: tuple[int, ...] = ()  # joined features: the same ticket as the encoder sees it ([CLS] text [SEP])


@dataclass(frozen=True)
class Prediction:
    label: str
    scores: dict[str, float]  # label -> probability
    truncated: bool
    n_tokens: int

    @property
    def score(self) -> float:
        return max(self.scores.values())


def padding_pct(real_tokens: int, padded_tokens: int) -> float:
    """Share of the computed tokens that were padding, in percent (0.0 when nothing was computed)."""
    return 100.0 * (padded_tokens - real_tokens) / padded_tokens if padded_tokens else 0.0


def percentile(values: Sequence[float], q: float, *, nearest: bool = False) -> float | None:
    """The ``q``-th percentile of ``values``; ``None`` for no values.

    Linear interpolation between closest ranks (numpy's default) unless ``nearest``:
    then the nearest-rank value, one that really occurred (the benchmark reports those).
    """
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be within [0, 100]")
    xs = sorted(values)
    if nearest:
        return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class PassStats:
    """What one forward call cost."""

    items: int
    real_tokens: int  # cost tokens of the rows, no padding (the prefix too when it was not cached)
    padded_tokens: int  # tokens the forward computed: items x width, padding included
    prefix_tokens_reused: int = 0  # prompt-prefix tokens read from the shared KV cache instead of computed
    infer_ms: float = 0.0  # launch (CUDA: or the read-back of the pass before, if later) to scores on the host
    gpu_ms: float | None = None  # the same pass on the device's clock (CUDA events); None off CUDA
    host_ms: float = 0.0  # host time spent on the pass (launch + postprocess; on the CPU: all of it)

    @property
    def padding_pct(self) -> float:
        return padding_pct(self.real_tokens, self.padded_tokens)


@dataclass
class RunStats:
    """Passes added up (one ``classify`` call, one window, or a summary period)."""

    items: int = 0
    passes: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prefix_tokens_reused: int = 0
    infer_ms: float = 0.0
    gpu_ms: float = 0.0  # device time of the passes (CUDA events; 0 off CUDA)
    host_ms: float = 0.0  # host time of the passes (launch + postprocess)
    pass_sizes: list[int] = field(default_factory=list)  # items per pass, in run order
    pass_stats: list[PassStats] = field(default_factory=list)  # each pass's own record, in run order

    @property
    def padding_pct(self) -> float:
        return padding_pct(self.real_tokens, self.padded_tokens)

    def add(self, p: PassStats) -> None:
        """Count one more pass, its items included."""
        self.items += p.items
        self.passes += 1
        self.real_tokens += p.real_tokens
        self.padded_tokens += p.padded_tokens
        self.prefix_tokens_reused += p.prefix_tokens_reused
        self.infer_ms += p.infer_ms
        self.gpu_ms += p.gpu_ms or 0.0
        self.host_ms += p.host_ms
        self.pass_sizes.append(p.items)
        self.pass_stats.append(p)

    def merge(self, other: RunStats) -> None:
        """Add another run's counters, its items included (a window or an RQ batch adding up its passes)."""
        self.items += other.items
        self.passes += other.passes
        self.real_tokens += other.real_tokens
        self.padded_tokens += other.padded_tokens
        self.prefix_tokens_reused += other.prefix_tokens_reused
        self.infer_ms += other.infer_ms
        self.gpu_ms += other.gpu_ms
        self.host_ms += other.host_ms
        self.pass_sizes.extend(other.pass_sizes)
        self.pass_stats.extend(other.pass_stats)


@dataclass(frozen=True)
class EngineOptions:
    """Every engine knob besides the model, the task and the scorer (the worker maps TRIAGE_* onto these)."""

    max_input_tokens: int = 512  # ticket tokens beyond this are truncated (or the ticket rejected)
    truncate: bool = True
    prefix_cache: bool = True  # reuse the prompt prefix's KV cache across passes
    pass_max_items: int = 64  # tickets per forward call at most
    pass_max_tokens: int = 8192  # tokens per forward call at most (padded: items x longest; packed: real)
    pass_overhead_tokens: int = 32  # planner's fixed price of one forward call, in token-equivalents
    confidence_threshold: float = 0.0  # below this top probability the label becomes fallback_label
    fallback_label: str = "needs_review"
    attention: str = "auto"  # padded | packed | auto (packed on CUDA, padded on CPU/MPS)
    attention_kernel: str = "auto"  # packed path's varlen kernel: flash | torch | auto (flash where usable)
    cuda_graphs: bool = True  # replay packed passes as CUDA graphs (CUDA + flash only)
    lookahead: str = "auto"  # on | off | auto (on CUDA): queue the next pass before reading this one back


def unicode_problem(text: str, name: str = "text") -> str | None:
    """Why ``text`` cannot be UTF-8 (None: it can): a lone surrogate, as JSON's "\\ud83d" (half an emoji) decodes.
    No tokenizer takes one (one such text failed its whole batch's call); the producer client, both workers and the
    engine refuse it with this reason. ``isascii`` is a flag read: ordinary tickets pay no encode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"{name} contains characters that are not valid Unicode (a lone surrogate at position {e.start}, "
            "e.g. half of an emoji): send UTF-8 text"
        )
    return None
