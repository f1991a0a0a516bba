"""What transformers' GGUF loader needs around it when the worker converts a GGUF once.

``from_pretrained(gguf_file=...)`` reads the file three times (tokenizer, config, weights), each time
parsing every metadata field again (SmolLM2's 49k-token vocabulary is ~100k small memmap reads), and
rebuilds gguf's tensor-name map once per module of the model. On a 2-core CPU the bundled model's
conversion took 38 s, of which the de-quantization itself was ~3 s. Sharing one reader and one name
map while converting brings it to 16 s and writes byte-identical files. Both are only read: the
reader's arrays are views of a read-only memmap, and the name map is a lookup table. transformers
imports both names from ``gguf`` inside its functions at call time (5.0 through 5.24), so swapping
the module's attributes for the length of the conversion reaches them; if a later version imports
them once at module level, the conversion is just slow again (tests/unit/test_gguf_load.py says so).
"""

from __future__ import annotations

import contextlib
import functools
import os

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def parsed_once():
    """While converting: one ``GGUFReader`` per file and one tensor-name map per (arch, blocks)."""
    try:
        import gguf
    except ImportError:  # transformers raises its own error for a missing gguf
        yield
        return
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


@contextlib.contextmanager
def bar_follows_switch():
    """transformers draws the GGUF de-quantization bar with a bare tqdm that ignores its own
    progress-bar switch (a raw bar in JSON logs); make it obey while converting."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
