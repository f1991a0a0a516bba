"""Pick the device and dtype: CUDA fp16, then MPS fp16, then the fastest exact-enough CPU dtype."""

from __future__ import annotations

import time
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
