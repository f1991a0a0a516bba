"""Variable-length attention kernels that also return the log-sum-exp, and the exact LSE merge.

Every kernel has flash-attention's varlen contract, so the packed path is one piece of
code whatever runs underneath:

    q [Tq, H, D], k/v [Tk, Hkv, D] (H a multiple of Hkv: grouped-query attention),
    cu_q / cu_k int32 [S + 1] (segment s = rows cu[s]:cu[s+1]; zero-length segments allowed),
    max_q / max_k >= the longest segment, causal aligned bottom-right (query i of a segment
    sees keys j <= i + len_k - len_q), returns out [Tq, H, D] and lse [H, Tq] (float32,
    natural log). Rows outside every segment are left undefined.

* ``torch``: plain torch ops, exact in fp32; what the CPU and the tests run, and the fp32
  path on CUDA (flash has no fp32).
* ``flash``: ``torch.ops.aten._flash_attention_forward`` (FlashAttention-2 inside PyTorch,
  CUDA, fp16/bf16, head_dim <= 256, native GQA). Called directly: no SDPA dispatch, so no
  cuDNN plan built per shape and no silent fallback to another backend.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Elements of one [segments, heads, q, k] score block in the torch kernel (fp32: 4 bytes each).
TORCH_BLOCK_ELEMENTS = 1 << 26


def varlen_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference varlen attention: segments gathered into a padded block, masked, softmax in fp32."""
    tq, h, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    group = h // hkv
    dev = q.device
    out = torch.zeros(tq, h, v.shape[-1], dtype=q.dtype, device=dev)
    lse = torch.full((h, tq), float("-inf"), dtype=torch.float32, device=dev)
    segments = cu_q.numel() - 1
    if segments == 0 or tq == 0 or tk == 0:
        return out, lse
    cu_q, cu_k = cu_q.long(), cu_k.long()
    ar_q = torch.arange(max_q, device=dev)
    ar_k = torch.arange(max_k, device=dev)
    chunk = max(1, TORCH_BLOCK_ELEMENTS // max(1, h * max_q * max_k))
    for s0 in range(0, segments, chunk):
        s1 = min(segments, s0 + chunk)
        len_q = cu_q[s0 + 1 : s1 + 1] - cu_q[s0:s1]  # [c]
        len_k = cu_k[s0 + 1 : s1 + 1] - cu_k[s0:s1]
        iq = cu_q[s0:s1, None] + ar_q[None, :]  # [c, Lq]
        ik = cu_k[s0:s1, None] + ar_k[None, :]  # [c, Lk]
        vq = ar_q[None, :] < len_q[:, None]
        vk = ar_k[None, :] < len_k[:, None]
        qs = q[iq.clamp(max=tq - 1)].float()  # [c, Lq, H, D]
        ks = k[ik.clamp(max=tk - 1)].float()  # [c, Lk, Hkv, D]
        vs = v[ik.clamp(max=tk - 1)].float()
        if group > 1:  # query head j reads kv head j // group (transformers' repeat_kv)
            ks = ks.repeat_interleave(group, dim=2)
            vs = vs.repeat_interleave(group, dim=2)
        scores = torch.einsum("cqhd,ckhd->chqk", qs, ks) * scale
        allowed = vq[:, None, :, None] & vk[:, None, None, :]
        if causal:
            shift = (len_k - len_q)[:, None, None]
            allowed = allowed & (ar_k[None, None, :] <= ar_q[None, :, None] + shift)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        seg_lse = torch.logsumexp(scores, dim=-1)  # [c, H, Lq]; -inf where a row sees nothing
        probs = torch.exp(scores - seg_lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
        probs = probs.masked_fill(~allowed, 0.0)
        o = torch.einsum("chqk,ckhd->cqhd", probs, vs)
        rows = iq[vq]
        out[rows] = o[vq].to(q.dtype)
        lse[:, rows] = seg_lse.permute(1, 0, 2)[:, vq]
    return out, lse


def varlen_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 varlen forward (CUDA). LSE comes back as [H, Tq] float32 (PyTorch's varlen layout)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )[:2]
    if lse.dim() == 3:  # older FlashAttention builds: padded per segment, [S, H, max_q]
        lse = lse_rows(lse, cu_q, q.shape[0])
    if lse.shape != (q.shape[1], q.shape[0]):  # a layout this code was not written for: fail loudly
        raise RuntimeError(f"unexpected flash LSE shape {tuple(lse.shape)} for q {tuple(q.shape)}")
    return out, lse


def lse_rows(lse: torch.Tensor, cu_q: torch.Tensor, tokens: int) -> torch.Tensor:
    """[S, H, max_q] (per segment, padded) -> [H, tokens], on the device without a host sync."""
    t = torch.arange(tokens, device=lse.device)
    seg = torch.searchsorted(cu_q[1:].long(), t, right=True).clamp(max=lse.shape[0] - 1)
    off = (t - cu_q.long()[seg]).clamp(0, lse.shape[2] - 1)
    return lse[seg, :, off].transpose(0, 1)


KERNELS: dict[str, Kernel] = {"torch": varlen_torch, "flash": varlen_flash}


def flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the flash kernel can run here (CUDA build with FlashAttention, half precision, head_dim <= 256)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > 256 or head_dim % 8:
        return False
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    return bool(available()) and hasattr(torch.ops.aten, "_flash_attention_forward")


def pick_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``auto``: flash where usable, else the exact torch kernel."""
    if requested == "auto":
        return "flash" if flash_usable(device, dtype, head_dim) else "torch"
    if requested == "flash" and not flash_usable(device, dtype, head_dim):
        raise ValueError(f"flash attention cannot run on {device} in {dtype} with head_dim {head_dim}")
    if requested not in KERNELS:
        raise ValueError(f"unknown attention kernel {requested!r} (auto, flash, torch)")
    return requested


def self_test(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> str | None:
    """Run ``kernel`` once against the torch kernel on small random rows (GQA 7:1, causal and not, a
    zero-length row, fewer queries than keys). None if it agrees, else what went wrong: the engine then
    falls back to the exact torch kernel instead of failing, or answering wrongly, on a new device."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q_lens, k_lens = [5, 0, 37, 1], [5, 0, 45, 3]
    q = torch.randn(sum(q_lens), 14, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(sum(k_lens), 2, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(sum(k_lens), 2, head_dim, generator=gen).to(device, dtype)
    cu = lambda lens: torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32).to(device)  # noqa: E731
    try:
        for causal in (True, False):
            args = (q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), causal, default_scale(head_dim))
            out, lse = KERNELS[kernel](*args)
            ref, ref_lse = varlen_torch(*args)
            err = max((out.float() - ref.float()).abs().max().item(), (lse - ref_lse).abs().max().item())
            if not err < 3e-2:
                return f"{kernel} differs from the torch kernel by {err:.3g} (causal={causal})"
    except Exception as e:  # noqa: BLE001 -- any failure means: do not use this kernel here
        return f"{kernel} failed: {type(e).__name__}: {e}"
    return None


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over key sets A and B from the results over each alone (exact).

    softmax over A u B = w * softmax_A + (1 - w) * softmax_B with
    w = exp(lse_A) / (exp(lse_A) + exp(lse_B)) = sigmoid(lse_A - lse_B): one fused lerp per layer.
    o [T, H, D], lse [H, T].
    """
    w = torch.sigmoid(lse1 - lse2).transpose(0, 1).unsqueeze(-1)  # [T, H, 1] weight of o1
    if o1.dtype == torch.float32:
        return torch.lerp(o2, o1, w)
    return torch.lerp(o2, o1, w.to(o1.dtype))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
