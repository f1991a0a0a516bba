"""Which attention a classifier runs, decided once at start-up: the rules read from the config
(``exactness``), then checks that run on the loaded model.

Packed attention swaps the model's attention function through transformers' attention registry and hands each
layer the call's layout through the forward's keyword arguments. A model whose own attention code does not go
through the registry (Bloom, GPT-Neo, XGLM) would run its attention over the whole packed stream as one
sequence, every ticket seeing the others; one whose layers drop the keyword arguments (StableLM, Falcon) fails
every pass; attention sinks (GPT-OSS) are not plain softmax. So before a classifier runs packed, two tiny rows
go through a packed call: every layer must attend through the packed function, and each row must come out as
it does alone. Otherwise the classifier runs padded (the model's own attention), with a warning.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from worker.engine import varlen
from worker.engine.compat import text_config
from worker.engine.exactness import FastPaths
from worker.engine.types import ConfigError

_PROBE_ROWS = ([3, 4, 5], [6, 7])  # token ids every vocabulary has


def setup_attention(
    model, fast: FastPaths, wanted: str, prefix_cache: bool, kernel: str, log: logging.Logger
) -> tuple[FastPaths, str, str]:
    """(fast paths, attention, kernel) for ``model``: ``wanted`` less what the rules in ``fast`` and the checks
    on the model rule out (each logged, the prefix cache's too); ``kernel`` (``EngineOptions.attention_kernel``)
    resolved, falling back to the exact torch kernel when the fast one fails its self-test."""
    cfg = text_config(model.config)
    heads = getattr(cfg, "num_attention_heads", None)
    if not heads:
        raise ConfigError(
            f"{cfg.model_type} models have no attention heads (a state-space model?): triage runs transformers",
            setting="TRIAGE_MODEL",
        )
    attention = fast.allowed(wanted, prefix_cache, log)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kernel = varlen.pick_kernel(kernel, model.device, model.dtype, head_dim)
    if attention != "packed":
        return fast, attention, kernel
    if kernel != "torch":
        problem = varlen.self_test(kernel, model.device, model.dtype, head_dim)
        if problem:
            log.warning("packed attention falls back to the torch kernel: %s", problem)
            kernel = "torch"
    checked = getattr(model, "_triage_packed_checked", {})  # once per loaded model and kernel
    if kernel not in checked:
        checked[kernel] = packed_problem(model, kernel)
        model._triage_packed_checked = checked
    problem = checked[kernel]
    if problem:
        log.warning("packed attention is off for this model: %s", problem)
        return dataclasses.replace(fast, packed=problem), "padded", kernel
    return fast, attention, kernel


@torch.inference_mode()
def packed_problem(model, kernel: str) -> str | None:
    """None when a packed call on ``model`` is its own attention (checked on two tiny rows); else why not."""
    from worker.engine.forward import decoder
    from worker.engine.packed import Layout, PackedCall, call_decoder, stream_tensors
    from worker.engine.transfer import upload

    if model.device.type == "meta":  # no numbers to compare
        return None
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return "its attention has sinks (GPT-OSS), which packed attention does not compute"
    dev = model.device
    layout = Layout.build([len(r) for r in _PROBE_ROWS])
    ids, pos, cu, _, _ = stream_tensors(_PROBE_ROWS, layout, 0, 0)
    call = PackedCall(kernel=kernel, cu_q=upload(cu, dev), max_q=layout.max_len, prefix=None)
    seen: set[int] = set()
    attend = call.attend

    def counted(layer, *args):
        seen.add(layer)
        return attend(layer, *args)

    call.attend = counted  # type: ignore[method-assign]
    try:
        packed = call_decoder(model, upload(ids, dev), upload(pos, dev), call).float()
        alone = [
            decoder(model)(input_ids=torch.tensor([r], device=dev), use_cache=False).last_hidden_state[0].float()
            for r in _PROBE_ROWS
        ]
        want = torch.cat(alone)
        err = ((packed - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    except Exception as e:  # noqa: BLE001 -- any failure means: not this model's attention
        return f"a packed call fails on it ({type(e).__name__}: {e})"
    layers = getattr(model.config, "num_hidden_layers", None)
    if not seen or (layers is not None and len(seen) != layers):
        return (
            f"its attention code ran the packed attention in {len(seen)} of {layers} layers "
            "(it does not go through transformers' attention registry)"
        )
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    if not err <= tolerance:
        return f"a packed call differs from each row run alone by {err:.2g} (relative; tolerance {tolerance:g})"
    return None
