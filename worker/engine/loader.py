"""Load a causal LM + tokenizer from a HF id, a local directory or a GGUF file.

GGUF files are de-quantized by transformers on every load (~10-25 s here), so the
first load converts once and caches safetensors under ``cache_dir`` keyed by the
source file's content (sources.py: the same GGUF in several virtualenvs converts once);
later starts load in about a second.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from worker.engine.sources import (  # noqa: F401  (re-exported: ModelNotFound, bundled_gguf_path, BUNDLED_GGUF)
    BUNDLED_GGUF,
    SOURCE_FILE,
    ModelNotFound,
    bundled_gguf_path,
    check_model_available,
    classify_model_name,
    converted_target,
    is_converted,
)

log = logging.getLogger("triage.loader")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what TRIAGE_MODEL said, for results and logs
    source: str  # where the weights actually came from


def load_model(name: str, device: torch.device, dtype: torch.dtype, cache_dir: Path) -> LoadedModel:
    # transformers' tqdm bars ("Loading weights") would print plain text into JSON logs
    hf_logging.disable_progress_bar()
    source = resolve_source(name, cache_dir)
    local = os.path.isdir(source)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local)
    model.to(device)
    model.train(False)  # inference mode: dropout off
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=str(source))


def resolve_source(name: str, cache_dir: Path) -> str:
    """A directory or hub id that ``from_pretrained`` can load without GGUF conversion.

    Fails fast (ModelNotFound) on a hub id that is neither cached nor reachable, and turns
    hub calls off when the model is local or cached (see sources.check_model_available)."""
    kind = check_model_available(name)
    if kind in ("bundled", "gguf"):
        return str(converted_gguf_dir(classify_model_name(name)[1], cache_dir))
    return str(Path(name).expanduser()) if kind == "dir" else name  # a hub id: from_pretrained uses the HF cache


def converted_gguf_dir(gguf: Path, cache_dir: Path) -> Path:
    target = converted_target(gguf, cache_dir)
    if is_converted(target):
        return target
    stat = gguf.stat()
    log.info("converting GGUF once (cached for later starts): %s -> %s", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with _gguf_bar_follows_switch():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The de-quantized weights are plain fp32 tensors; drop the GGUF quantizer
        # marker so save_pretrained writes ordinary safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size}))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def _gguf_bar_follows_switch():
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
