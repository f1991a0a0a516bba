"""Which fast paths reproduce a model's own attention exactly, read from its config.

The prefix cache (``PrefixKV.expanded``) and the packed path (``packed.PackedCall``) both assume every
layer attends causally to every earlier token with plain softmax. A sliding-window layer (Gemma 2/3,
Mistral) sees only its window, and a logit soft-cap (Gemma 2) changes the softmax: there the fast paths
would give other answers than the model, so the classifier runs the padded path without a prefix cache
(the model's own attention, the reference), and multi-token labels' continuations one ticket per call.
MPT's ALiBi counts key slots, so only the continuations (which follow a padded row) run one ticket per call.
What the config cannot tell (a model whose attention code the packed swap does not reach) is checked on the
loaded model (``attention_setup``).
A window no row reaches is no limit at all: Mistral's 4,096
tokens never bind a ticket prompt, so it keeps every fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
UNKNOWN = -1  # a layer kind the fast paths know nothing about


@dataclass(frozen=True)
class FastPaths:
    prefix_cache: str | None = None  # why the prefix cache is off for this model (None: it is exact)
    packed: str | None = None  # why packed attention is off (None: it is exact)
    # why label continuations run one ticket at a time: a window counts cache slots, and after a right-padded
    # row the padding slots would push real tokens out of the continuation's window
    continuations_alone: str | None = None

    def allowed(self, attention: str, prefix_cache: bool, log) -> str:
        """The attention a classifier may run of the one it wants; logs each fast path wanted and ruled out."""
        if attention == "packed" and self.packed:
            log.warning("packed attention is off for this model: %s", self.packed)
            attention = "padded"
        if prefix_cache and self.prefix_cache:
            log.warning("the prompt prefix cache is off for this model: %s", self.prefix_cache)
        return attention


def fast_paths(config: Any, longest: int) -> FastPaths:
    """What the fast paths can do for rows of up to ``longest`` tokens (prefix + ticket + label continuation)."""
    window = _narrowest_window(config)
    cache = packed = None
    if window == UNKNOWN:
        cache = packed = f"the model has layers of kinds {_kinds(config)} besides {FULL!r}"
    elif window is not None and window < longest:
        cache = packed = (
            f"the model attends through a {window}-token window and rows reach {longest} tokens (prefix and ticket); "
            "lower TRIAGE_MAX_INPUT_TOKENS so that prompt and ticket fit in the window to keep the fast paths"
        )
    if packed is None and getattr(config, "attn_logit_softcapping", None) is not None:
        packed = "the model soft-caps its attention logits (attn_logit_softcapping), which packed attention does not"
    alone = cache
    if alone is None and _alibi_by_slot(config):
        alone = "the model's ALiBi counts key slots (MPT): after a padded row the padding would count as distance"
    return FastPaths(prefix_cache=cache, packed=packed, continuations_alone=alone)


def _alibi_by_slot(config: Any) -> bool:
    """ALiBi biased by the key's slot in the cache rather than by the attention mask (MPT): padding is distance."""
    if getattr(config, "model_type", None) != "mpt":
        return False
    attn = getattr(config, "attn_config", None)
    alibi = attn.get("alibi", True) if isinstance(attn, dict) else getattr(attn, "alibi", True)
    return bool(alibi)


def _kinds(config: Any) -> list[str]:
    return sorted(set(getattr(config, "layer_types", None) or []) - {FULL})


def _narrowest_window(config: Any) -> int | None:
    """The smallest span any layer attends over (None: every layer sees everything)."""
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", None) is False:  # Qwen2: a window configured but switched off
        sliding = None
    chunk = getattr(config, "attention_chunk_size", None)
    if types is None:  # no per-layer kinds (Mistral): a window set in the config applies to every layer
        spans = [s for s in (sliding, chunk) if s is not None]
        return min(spans) if spans else None
    spans = []
    for kind in set(types) - {FULL}:
        if kind == "sliding_attention" and sliding is not None:
            spans.append(sliding)
        elif kind == "chunked_attention" and chunk is not None:
            spans.append(chunk)
        else:
            return UNKNOWN
    return min(spans) if spans else None
