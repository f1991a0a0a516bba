"""fp16's range on the model's own weights, checked once at load.

``TRIAGE_DTYPE=auto`` picks fp16 on a GPU. A model whose numbers pass fp16's 65,504 (weights, or activations such
as a first-token "attention sink") gives NaN or inf on every ticket, and every ticket would be dead-lettered. One
forward call over a probe sentence says so; the loader then loads the safer dtype (``assemble.load``), so every
process that builds through it (worker, bench, eval, verify) serves the same dtype."""

from __future__ import annotations

import torch

from worker.engine.loader import LoadedModel

PROBE_TEXT = "I was charged twice for my order and the app crashes when I open the invoice."


def outputs_finite(loaded: LoadedModel) -> bool:
    """Whether the model's outputs over ``PROBE_TEXT`` are all finite (a causal LM's logits, an encoder's states)."""
    enc = loaded.tokenizer(PROBE_TEXT, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model(**{k: v.to(loaded.model.device) for k, v in enc.items()})
    states = out.logits if loaded.kind == "decoder" else out.last_hidden_state
    return bool(torch.isfinite(states).all())


def safer_dtype(device: torch.device) -> str:
    """What auto falls back to from fp16: bf16 (fp32's range) where the GPU has it, else fp32."""
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
