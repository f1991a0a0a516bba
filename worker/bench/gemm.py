"""Distance to the limit: the device's dense matmul FLOP/s, and how many FLOPs a run really needed.

MFU here = useful model FLOPs per second / measured GEMM FLOP/s, where the GEMM
is timed in the same process, dtype and device, at the model's own linear-layer
shapes. A peak from a datasheet would hide what this (shared, throttled) machine
can actually do; a measured one makes the ratio honest.

FLOP convention (documented in docs/benchmark.md):
  linear:    2 x N_nonemb per token (N_nonemb = all parameters except the token
             embedding and an untied LM head; the label scorer projects onto a
             handful of LM-head rows only, so the head is not counted)
  attention: 4 x layers x (heads x head_dim) per (query, key) pair the causal
             mask allows (QK^T and AV, each 2 FLOPs per multiply-add)
Useful ("work") FLOPs count only the ticket suffix tokens, attending to the
prefix and to earlier suffix tokens; the prefix itself is computed once (cached)
and is not work. Computed FLOPs count every position the forward pass ran,
padding and re-computed prefixes included (padded positions counted causally).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    non_embedding_params: int
    causal: bool = True  # an encoder's tokens attend both ways: s^2 query-key pairs, not s(s+1)/2

    @classmethod
    def from_model(cls, model, causal: bool = True) -> ModelShape:
        """Its shape; ``non_embedding_params`` leaves out every embedding table (tokens, positions, token types),
        an untied LM head and an encoder's pooler (one token a row): the per-token matmuls alone."""
        import torch

        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        total = sum(p.numel() for p in model.parameters())
        emb = model.get_input_embeddings().weight
        tables = {m.weight.data_ptr(): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        tables[emb.data_ptr()] = emb.numel()
        out = model.get_output_embeddings()
        untied_head = out.weight.numel() if out is not None and out.weight.data_ptr() not in tables else 0
        pooler = getattr(model, "pooler", None)
        pooled = sum(p.numel() for p in pooler.parameters()) if isinstance(pooler, torch.nn.Module) else 0
        return cls(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            non_embedding_params=total - sum(tables.values()) - untied_head - pooled,
            causal=causal,
        )

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of one decoder layer's matmuls."""
        h, a, kv, i = self.hidden, self.attn_width, self.kv_heads * self.head_dim, self.intermediate
        return [("q", h, a), ("k", h, kv), ("v", h, kv), ("o", a, h), ("gate", h, i), ("up", h, i), ("down", i, h)]

    def as_dict(self) -> dict:
        return asdict(self)


def row_flops(shape: ModelShape, tokens: int, past: int = 0) -> float:
    """FLOPs for ``tokens`` positions that follow ``past`` cached ones (causal attention; an encoder's: every pair)."""
    own = tokens * (tokens + 1) / 2 if shape.causal else tokens * tokens
    pairs = past * tokens + own  # keys each query may attend to, summed
    return 2.0 * shape.non_embedding_params * tokens + 4.0 * shape.layers * shape.attn_width * pairs


def work_flops(shape: ModelShape, prefix_len: int, suffix_lengths: Iterable[int]) -> float:
    """Useful FLOPs: each ticket's suffix after a (cached) prefix, no padding."""
    return sum(row_flops(shape, n, past=prefix_len) for n in suffix_lengths)


def computed_flops(
    shape: ModelShape,
    batches: Sequence,
    prefix_len: int,
    cached: bool,
    pad_to: int | None = None,
    packed: bool = False,
    extra_tokens: int = 0,
) -> float:
    """FLOPs the forward passes ran: every row padded to its batch width (or ``pad_to``); packed: each row its own
    length, plus ``extra_tokens`` a CUDA graph's shape added (outside every row: their linear FLOPs only).

    ``batches`` are ``bucketing.Pass`` objects whose lengths are the model's cost lengths
    (suffix only when cached, prefix + suffix when not).
    """
    total = 2.0 * shape.non_embedding_params * extra_tokens
    past = prefix_len if cached else 0
    for b in batches:
        if packed:
            total += sum(row_flops(shape, n, past=past) for n in b.lengths)
        else:
            total += b.size * row_flops(shape, max(b.max_len, pad_to or 0), past=past)
    return total


@dataclass(frozen=True)
class GemmResult:
    device: str
    dtype: str
    tokens: int  # M of every GEMM
    shapes: tuple[dict, ...]  # per layer matmul: name, m, k, n, seconds, flops_per_s
    flops_per_s: float  # all shapes together: sum(FLOPs) / sum(best wall seconds)
    flops_per_cpu_s: float  # the same per process CPU second (all threads): what MFU (CPU time) divides by

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "shapes": list(self.shapes),
            "flops_per_s": self.flops_per_s,
            "flops_per_cpu_s": self.flops_per_cpu_s,
        }


def measure_gemm(shape: ModelShape, device, dtype, tokens: int, reps: int = 5, min_rep_s: float = 0.02) -> GemmResult:
    """Time ``x[tokens, k] @ W[n, k].T`` for each of the model's linear shapes; best of ``reps``.

    Best-of (not mean) because other processes share this machine: the fastest
    repetition is the closest to what the hardware can do, and MFU against it is
    a conservative (lower) figure.
    """
    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, total_flops, total_s, total_cpu = [], 0.0, 0.0, 0.0
    with torch.inference_mode():
        for name, k, n in shape.linear_shapes():
            x = torch.randn(tokens, k, generator=gen).to(dev, dtype)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dtype)
            F.linear(x, w)  # warm-up (allocations, kernel selection)
            sync()
            inner = _calls_per_rep(lambda x=x, w=w: F.linear(x, w), sync, min_rep_s)
            best = best_cpu = float("inf")
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(inner):
                    F.linear(x, w)
                sync()
                best = min(best, (time.perf_counter() - t0) / inner)
                best_cpu = min(best_cpu, (time.process_time() - c0) / inner)
            flops = 2.0 * tokens * k * n
            rows.append(
                {
                    "name": name,
                    "m": tokens,
                    "k": k,
                    "n": n,
                    "seconds": best,
                    "cpu_seconds": best_cpu,
                    "flops_per_s": flops / best,
                }
            )
            total_flops += flops
            total_s += best
            total_cpu += best_cpu
    name = str(dtype).replace("torch.", "")
    return GemmResult(str(dev), name, tokens, tuple(rows), total_flops / total_s, total_flops / max(total_cpu, 1e-9))


def _calls_per_rep(fn, sync, min_rep_s: float) -> int:
    """Enough back-to-back calls that one repetition lasts ``min_rep_s`` (timer resolution, launch jitter)."""
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    return max(1, min(1000, int(min_rep_s / one)))
