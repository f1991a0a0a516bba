"""What a causal LM does to its LM head's output before it is a next-token logit.

The prompt scorer projects hidden states onto the label tokens' rows of the LM head itself (a few rows, not
the vocabulary), so it must apply the same final step the model's own forward applies: Granite divides by
``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2 soft-caps (``final_logit_softcapping``).
Without it the label probabilities are not the model's (the fast paths and the reference agreed, both wrong).
The config only says what a field holds, not that the model uses it (MPT has a ``logit_scale`` it never applies),
so ``final_step`` keeps the config's step only where it reproduces the model's own logits on a tiny input, and
names a model that neither it nor no step reproduces in the log instead of scoring it quietly otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.engine.compat import text_config

Transform = Callable[[torch.Tensor], torch.Tensor]


def final_step(model) -> tuple[Transform | None, str | None]:
    """(the step that makes the LM head's output the model's own logits, None if neither the config's step nor
    no step does; else why not). Checked once per loaded model (two small forwards): every scorer built on it
    (eval's prompt variants, the bench's modes) reuses the answer."""
    found = getattr(model, "_triage_final_step", None)
    if found is None:
        found = _check_final_step(model)
        model._triage_final_step = found  # a plain attribute: not a parameter, buffer or submodule
    return found


def _check_final_step(model) -> tuple[Transform | None, str | None]:
    try:
        from_config = final_logit_transform(model.config)
    except (TypeError, ValueError):  # a field that is no number (MPT's logit_scale "inv_sqrt_d_model")
        from_config = None
    first = None
    for candidate in ([from_config] if from_config is not None else []) + [None]:
        problem = head_problem(model, candidate)
        if problem is None:
            return candidate, None
        first = first or problem
    return from_config, first


def final_logit_transform(config) -> Transform | None:
    """The final logit step a config describes, as a function of the LM head's output (None: it describes none)."""
    cfg = text_config(config)
    scale = 1.0
    if getattr(cfg, "logits_scaling", None):  # Granite: logits / logits_scaling
        scale /= float(cfg.logits_scaling)
    if getattr(cfg, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(cfg.logit_scale)
    cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2: cap * tanh(logits / cap)
    if scale == 1.0 and not cap:
        return None

    def apply(logits: torch.Tensor) -> torch.Tensor:
        if scale != 1.0:
            logits = logits * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


@torch.inference_mode()
def head_problem(model, transform: Transform | None) -> str | None:
    """None when ``transform(LM head(hidden states))`` is the model's own logits on a tiny input; else by how much
    they differ (relative), or why they could not be compared."""
    from worker.engine.forward import decoder

    if model.device.type == "meta":  # no numbers to compare
        return None
    ids = torch.tensor([[3, 4, 5]], device=model.device)
    try:
        own = model(input_ids=ids, use_cache=False).logits[0].float()
        hidden = decoder(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
        ours = model.get_output_embeddings()(hidden).float()
        if transform is not None:
            ours = transform(ours)
        err = ((ours - own).abs().max() / own.abs().max().clamp(min=1e-6)).item()
    except Exception as e:  # noqa: BLE001 -- a model this check cannot run is left to the scorer itself
        return f"could not be compared ({type(e).__name__}: {e})"
    tolerance = 1e-4 if model.dtype == torch.float32 else 2e-2
    return None if err <= tolerance else f"differ by {err:.2g} (relative; tolerance {tolerance:g})"
