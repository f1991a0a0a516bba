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

import itertools
import math
from collections.abc import Callable

import torch

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Scores of one [segments, heads, q, k] block of the torch kernel at most (fp32: 4 bytes each).
TORCH_BLOCK_ELEMENTS = 1 << 26
# PyTorch's CPU flash kernel returns the LSE too; the matmul path below is the fallback (and CUDA's fp32 path).
CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


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
    """Reference varlen attention in fp32: segments of similar length gathered into padded blocks, masked.

    Segments are grouped by the power of two of their query length (padding inside a block stays
    under 2x) and blocks are capped at ``TORCH_BLOCK_ELEMENTS`` scores. On the CPU each block goes
    to PyTorch's CPU flash kernel (which returns the LSE too); elsewhere to plain matmuls. Reads
    the segment lengths on the host: never used inside a CUDA graph.
    """
    tq, h, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    group = h // hkv
    dev = q.device
    out = torch.zeros(tq, h, v.shape[-1], dtype=q.dtype, device=dev)
    lse = torch.full((h, tq), float("-inf"), dtype=torch.float32, device=dev)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    lens_q = [b - a for a, b in zip(starts_q, starts_q[1:])]
    lens_k = [b - a for a, b in zip(starts_k, starts_k[1:])]
    live = [s for s in range(len(lens_q)) if lens_q[s] and lens_k[s]]
    live.sort(key=lambda s: (lens_q[s], lens_k[s]))
    blocks, cur, cur_k = [], [], 0  # cur_k: the longest key run in the block being filled
    for s in live:
        lq, lk = lens_q[s], max(cur_k, lens_k[s])
        if cur:
            same_octave = lq.bit_length() == lens_q[cur[0]].bit_length()
            if not same_octave or (len(cur) + 1) * h * lq * lk > TORCH_BLOCK_ELEMENTS:
                blocks.append(cur)
                cur, lk = [], lens_k[s]
        cur.append(s)
        cur_k = lk
    if cur:
        blocks.append(cur)
    for seg in blocks:
        lq, lk = max(lens_q[s] for s in seg), max(lens_k[s] for s in seg)
        len_q = torch.tensor([lens_q[s] for s in seg], device=dev)
        len_k = torch.tensor([lens_k[s] for s in seg], device=dev)
        ar_q, ar_k = torch.arange(lq, device=dev), torch.arange(lk, device=dev)
        iq = torch.tensor([starts_q[s] for s in seg], device=dev)[:, None] + ar_q[None, :]  # [c, Lq]
        ik = torch.tensor([starts_k[s] for s in seg], device=dev)[:, None] + ar_k[None, :]
        vq = ar_q[None, :] < len_q[:, None]
        vk = ar_k[None, :] < len_k[:, None]
        qs = q[iq.clamp(max=tq - 1)].float().transpose(1, 2)  # [c, H, Lq, D]
        ks = k[ik.clamp(max=tk - 1)].float().transpose(1, 2)  # [c, Hkv, Lk, D]
        vs = v[ik.clamp(max=tk - 1)].float().transpose(1, 2)
        if group > 1:  # query head j reads kv head j // group (transformers' repeat_kv)
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
        allowed = vq[:, :, None] & vk[:, None, :]  # [c, Lq, Lk]
        if causal:
            shift = (len_k - len_q)[:, None, None]
            allowed = allowed & (ar_k[None, None, :] <= ar_q[None, :, None] + shift)
        o, seg_lse = _attend_block(qs, ks, vs, allowed[:, None], scale)  # [c, H, Lq, D], [c, H, Lq]
        rows = iq[vq]
        out[rows] = o.transpose(1, 2)[vq].to(q.dtype)
        lse[:, rows] = seg_lse.permute(1, 0, 2)[:, vq]
    return out, lse


def _attend_block(q, k, v, allowed, scale):
    """Softmax attention of a padded block [c, H, L, D] under a boolean mask [c, 1, Lq, Lk]; returns (out, lse)."""
    if CPU_FLASH and q.device.type == "cpu":
        bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
        cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return cpu_flash(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    seg_lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees nothing
    probs = torch.exp(scores - seg_lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
    return probs @ v, seg_lse


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
    """FlashAttention-2 varlen forward (CUDA). LSE comes back as [H, Tq] float32 (PyTorch's varlen layout).

    ``max_q`` is at least 2: with ``max_q == 1`` and grouped-query heads, FlashAttention may swap the
    query-group and sequence axes (its decoding shortcut), which changes the LSE's layout. A larger
    bound only adds empty thread blocks; single-token label continuations hit exactly that case.
    """
    max_q = max(max_q, 2)
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
    """Run ``kernel`` against the torch kernel on small random rows: GQA 7:1, causal and not, a zero-length
    row, fewer queries than keys, and one-token rows (label continuations). None if it agrees, else what went
    wrong: the engine then falls back to the exact torch kernel instead of failing, or answering wrongly."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    cases = [([5, 0, 37, 1], [5, 0, 45, 3], (True, False)), ([1, 1, 1], [4, 9, 2], (True,))]
    try:
        for q_lens, k_lens, causals in cases:
            q = torch.randn(sum(q_lens), 14, head_dim, generator=gen).to(device, dtype)
            k = torch.randn(sum(k_lens), 2, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(sum(k_lens), 2, head_dim, generator=gen).to(device, dtype)
            cu_q, cu_k = (
                torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32).to(device) for x in (q_lens, k_lens)
            )
            for causal in causals:
                args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal, default_scale(head_dim))
                out, lse = KERNELS[kernel](*args)
                ref, ref_lse = varlen_torch(*args)
                rows = torch.cat([torch.arange(a, b) for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]).to(device)
                err = max(
                    (out.float() - ref.float())[rows].abs().max().item(), (lse - ref_lse)[:, rows].abs().max().item()
                )
                if not err < 3e-2:
                    return f"{kernel} differs from the torch kernel by {err:.3g} (rows {q_lens}, causal={causal})"
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
