"""Host-to-device copies that queue behind the device's work instead of waiting for it.

A plain ``t.to("cuda")`` from pageable memory is a blocking copy: PyTorch synchronises the
stream around it. In a pass that means the host waits for every pass already queued, so the
one-pass lookahead of ``Classifier.classify_passes`` would overlap nothing: pass k+1's token
stream is built and launched only after pass k is done. Copied from pinned memory with
``non_blocking=True`` the copy is just queued; PyTorch's caching host allocator keeps the
pinned block alive until the copy has run, so the host tensor may go at once.

The meta device takes the CUDA route without the pinning (it has no data, and a CPU-only torch
cannot pin): the tests check on it that a pass makes no blocking copy. MPS and CPU keep plain copies.
"""

from __future__ import annotations

import torch

_QUEUED = ("cuda", "meta")


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``; on CUDA without blocking the host."""
    return staged(t, device).to(device, non_blocking=device.type in _QUEUED)


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` ready for ``dst.copy_(t, non_blocking=True)`` into a tensor on ``device`` (pinned for CUDA)."""
    return t.pin_memory() if device.type == "cuda" else t
