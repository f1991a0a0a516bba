"""Length-bucketed pass planning. Pure Python: no torch, no Redis.

A *pass* is one forward call. Sorting items by token length and padding each pass
only to its own longest item keeps padding waste small; the budget counts *padded* tokens
(``items x longest``, as text-embeddings-inference does) because that is what
the forward pass actually computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.types import padding_pct


@dataclass(frozen=True)
class Pass:
    """Indices (into the caller's list) of items run together in one forward call, and their cost lengths."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.indices)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.size * self.max_len


@dataclass(frozen=True)
class PaddingStats:
    real_tokens: int
    padded_tokens: int

    @property
    def padding_tokens(self) -> int:
        return self.padded_tokens - self.real_tokens

    @property
    def padding_pct(self) -> float:
        return padding_pct(self.real_tokens, self.padded_tokens)

    @property
    def waste_factor(self) -> float:
        """Tokens computed per real token (1.0 = no padding)."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 1.0


def plan_passes(
    lengths: Sequence[int],
    max_items: int,
    max_tokens: int,
    overhead_tokens: int = 32,
) -> list[Pass]:
    """Sort by length, then cut the sorted run into passes at minimum total cost.

    Cost of a pass = its padded tokens (``n x longest``) + ``overhead_tokens``
    (the fixed price of one forward call: weight reads, kernel launches, in
    token-equivalents). Each pass respects ``n <= max_items`` and
    ``n x longest <= max_tokens``; an item longer than the whole budget goes
    alone. A small dynamic programme over the sorted lengths finds the optimal
    contiguous cut (a greedy fill would, e.g., pad a few short tickets up to one
    long outlier). Ties keep arrival order, so the plan is deterministic.
    """
    order = _by_length(lengths, max_items, max_tokens)
    srt = [lengths[i] for i in order]
    n = len(srt)
    inf = float("inf")
    best = [0.0] + [inf] * n  # best[j]: cost of the first j sorted items
    cut = [0] * (n + 1)  # cut[j]: start of the last pass in that optimum
    for j in range(1, n + 1):
        longest = srt[j - 1]
        for size in range(1, min(max_items, j) + 1):
            if size > 1 and size * longest > max_tokens:
                break
            cost = best[j - size] + size * longest + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, j - size
    spans = []
    j = n
    while j > 0:
        spans.append((cut[j], j))
        j = cut[j]
    return [_make(order[a:b], lengths) for a, b in reversed(spans)]


def plan_packed(lengths: Sequence[int], max_items: int, max_tokens: int) -> list[Pass]:
    """Packed passes (no padding): sort by length, fill each pass up to the caps.

    A packed pass computes its real tokens only, so its cost is ``sum(lengths)`` + the
    per-call overhead: every cut costs the same tokens and the fewest passes win, which a
    greedy fill of the sorted run gives (caps: ``n <= max_items``, ``sum(lengths) <=
    max_tokens``; an item over the budget goes alone). Sorting keeps short tickets
    together (their results come first) and bounds each pass's longest row, which
    sizes the attention kernel's grid. O(n log n): fine for windows of many thousands.
    """
    order = _by_length(lengths, max_items, max_tokens)
    out, cur, tokens = [], [], 0
    for i in order:
        if cur and (len(cur) >= max_items or tokens + lengths[i] > max_tokens):
            out.append(_make(cur, lengths))
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        out.append(_make(cur, lengths))
    return out


def plan_arrival_order(lengths: Sequence[int], items_per_pass: int) -> list[Pass]:
    """Fixed-size passes in arrival order (naive batching; the benchmark's baseline)."""
    return [
        _make(list(range(s, min(s + items_per_pass, len(lengths)))), lengths)
        for s in range(0, len(lengths), items_per_pass)
    ]


def padding_stats(passes: Sequence[Pass], pad_to: int | None = None) -> PaddingStats:
    """Real vs computed tokens; ``pad_to`` pads every pass to one global length instead."""
    real = sum(b.real_tokens for b in passes)
    padded = sum(b.size * (pad_to if pad_to is not None else b.max_len) for b in passes)
    return PaddingStats(real_tokens=real, padded_tokens=padded)


def _by_length(lengths: Sequence[int], max_items: int, max_tokens: int) -> list[int]:
    """Indices sorted by length, ties in arrival order (after checking the caps and the lengths)."""
    if max_items < 1 or max_tokens < 1:
        raise ValueError("max_items and max_tokens must be >= 1")
    if any(n < 1 for n in lengths):
        raise ValueError("every item needs at least one token")
    return sorted(range(len(lengths)), key=lambda i: (lengths[i], i))


def _make(indices: list[int], lengths: Sequence[int]) -> Pass:
    return Pass(indices=tuple(indices), lengths=tuple(lengths[i] for i in indices))
