"""Pick the device and dtype: CUDA fp16, then MPS fp16, then the fastest exact-enough CPU dtype."""

from __future__ import annotations

import math
import os
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


# At or below this many usable CPUs, "auto" runs one intra-op thread (docs/benchmark.md, "Threads"):
# on a busy 2-core host two threads were 4-6x slower than one (every op's barrier waits for a
# core another process holds), and small hosts are the ones that get shared.
AUTO_ONE_THREAD_MAX_CPUS = 4


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a container's CPU quota (cgroup v2 or v1),
    which torch's own default ignores (a pod limited to 1 CPU on a 64-core node would start 32 threads)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(n, quota)) if quota else max(1, n)


def _cgroup_cpu_quota() -> int | None:
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read())  # v1: -1 = no limit
        period_us = int(open("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read())
        return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def pick_threads(requested: int | str, device: torch.device) -> int | None:
    """Intra-op threads to set, or None to leave torch's default.

    ``N`` >= 1: N. ``0``: torch's default. ``"auto"``: on CPU, 1 thread when at most
    AUTO_ONE_THREAD_MAX_CPUS CPUs are usable, else the usable count when a container quota
    caps it below torch's default, else torch's default; on a GPU, torch's default.
    """
    if requested != "auto":
        return int(requested) or None
    if device.type != "cpu":
        return None
    cpus = usable_cpus()
    if cpus <= AUTO_ONE_THREAD_MAX_CPUS:
        return 1
    return cpus if cpus < torch.get_num_threads() else None


def pick_tokenize_threads(requested: int | str) -> int:
    """Threads that tokenize a window: ``N`` >= 1: N; ``"auto"``: the usable CPUs (``usable_cpus``)."""
    return usable_cpus() if requested == "auto" else max(1, int(requested))


def set_tokenize_threads(n: int) -> None:
    """Tokenize batches on ``n`` threads (the tokenizers library's Rust pool; 1: the calling thread only).

    Process-wide. The library reads TOKENIZERS_PARALLELISM at every call, RAYON_NUM_THREADS once, when its
    pool starts: so this is set before anything tokenizes. The worker's reader tokenizes a whole window in
    one call with the interpreter lock released: 4,096 tickets took 253 ms on one thread here, 135 ms on
    two, and a fresh worker's first window has no pass to overlap it with."""
    if n > 1 and _pool_lost_by_fork:
        n = 1
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if n > 1 else "false"
    if n > 1:
        os.environ["RAYON_NUM_THREADS"] = str(n)
        _guard_forks()


_pool_lost_by_fork = False


@lru_cache(maxsize=1)
def _guard_forks() -> None:
    """A child forked after the pool started (RQ's forking Worker, a preloaded parent) inherits the pool's
    bookkeeping but none of its threads: a parallel encode there waits forever (seen here). The library
    turns its pool off in such a child only while TOKENIZERS_PARALLELISM is unset, and the worker sets it,
    so a forked child of this process tokenizes on its calling thread."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    global _pool_lost_by_fork
    _pool_lost_by_fork = True
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def tokenize_threads() -> int:
    """The threads batches are tokenized on now, as ``set_tokenize_threads`` left them (for logs and the bench)."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("false", "0", "off", "no", "n", "f"):
        return 1
    return int(os.environ.get("RAYON_NUM_THREADS") or 0) or usable_cpus()


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
