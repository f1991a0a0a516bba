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
    """Whether the model's outputs over ``PROBE_TEXT`` are all finite (a causal LM's logits, an encoder's states),
    in the chat format where the tokenizer has one: its control tokens are where a model's largest activations
    are (a first-token "attention sink"), and every prompt the engine builds holds them."""
    ids = loaded.tokenizer(_probe_text(loaded), add_special_tokens=loaded.kind != "decoder")["input_ids"]
    input_ids = torch.tensor([ids], device=loaded.model.device)
    with torch.inference_mode():  # the arguments the engine passes, nothing more (no token types)
        out = loaded.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    states = out.logits if loaded.kind == "decoder" else out.last_hidden_state
    return bool(torch.isfinite(states).all())


def _probe_text(loaded: LoadedModel) -> str:
    tok = loaded.tokenizer
    if loaded.kind == "decoder" and getattr(tok, "chat_template", None):
        try:
            messages = [{"role": "user", "content": PROBE_TEXT}]
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses this turn: the plain sentence still probes
            pass
    return PROBE_TEXT


def safer_dtype(device: torch.device) -> str:
    """What auto falls back to from fp16: bf16 (fp32's range) where the GPU runs it natively (an emulated bf16, as
    on a V100 or T4, is slow), else fp32."""
    if device.type != "cuda":
        return "fp32"
    with torch.cuda.device(device):
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
