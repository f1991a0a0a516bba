"""Pick the device and dtype: CUDA fp16, then MPS fp16, then the fastest exact-enough CPU dtype."""

from __future__ import annotations

import time
from contextlib import nullcontext
from functools import lru_cache

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def pick_device(requested: str = "auto") -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    if device.type in ("cuda", "mps"):
        return torch.float16
    return fastest_cpu_dtype()


@lru_cache(maxsize=1)
def fastest_cpu_dtype(speedup_needed: float = 1.3) -> torch.dtype:
    """bf16 if it beats fp32 clearly on a model-shaped GEMM here, else fp32.

    fp16 is never chosen on CPU: without native fp16 kernels it runs several
    times slower than bf16 (measured ~7x on the dev machine).
    """
    fp32 = _gemm_seconds(torch.float32)
    bf16 = _gemm_seconds(torch.bfloat16)
    return torch.bfloat16 if fp32 / bf16 >= speedup_needed else torch.float32


def _gemm_seconds(dtype: torch.dtype, m: int = 256, k: int = 576, n: int = 1536, reps: int = 8) -> float:
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


ATTENTION_MODES = ("auto", "padded", "packed")


def pick_attention(requested: str, device: torch.device) -> str:
    """``auto``: packed on CUDA (no padding, prefix K/V shared by LSE merge), padded length buckets on CPU/MPS.

    On the CPU one short pass already keeps the cores busy and the padded path measured
    fastest there; packed runs anywhere (its plain-torch kernel is exact) and is what the
    CUDA path computes, so ``packed`` on CPU is the way to test it without a GPU.
    """
    if requested not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {requested!r}")
    if requested == "auto":
        return "packed" if device.type == "cuda" else "padded"
    return requested


def sdpa_context(device: torch.device):
    """The padded path's SDPA backends, chosen explicitly on CUDA: never cuDNN.

    cuDNN SDPA builds an execution plan for every new (batch, length) shape (~2.4 ms a call
    measured on an H200, 63% of a profile), and length buckets make every pass a new shape.
    Elsewhere (CPU, MPS) SDPA's own choice is kept.
    """
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
