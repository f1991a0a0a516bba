"""transformers 5.x differences the engine must bridge: 5.0 (the declared floor, ``make test-lower``), 5.17 (the
GPU box) and 5.24 (here).

5.24 renamed the decoder's ``past_key_values`` argument and output field to ``cache``
(the old keyword is still accepted there); 5.17 knows only ``past_key_values``, and an
unknown ``cache=`` keyword would be swallowed by ``**kwargs`` and silently ignored.
So the keyword is looked up once per decoder class from its ``forward`` signature.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=32)
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(
        f"{cls.__name__}.forward takes neither `cache` nor `past_key_values`: an unsupported transformers version"
    )


def cache_kwarg(module: torch.nn.Module) -> str:
    """The keyword under which ``module.forward`` takes a KV cache."""
    return _cache_kwarg_for(type(module))


def output_cache(out):
    """The KV cache of a decoder output (``out.cache`` on 5.24, ``out.past_key_values`` on 5.17)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def text_config(config):
    """The language model's part of a config: a composite one (Gemma 3's image-text model, which
    ``AutoModelForCausalLM`` loads for a gemma3 checkpoint) keeps heads, windows and positions in its text config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
