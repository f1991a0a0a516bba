"""A cheap fingerprint of a backbone's weights: what ties a fitted head to a model (``Head.check``).

Why not the name: TRIAGE_MODEL names a path or a hub id; the weights behind one name can change (a
fine-tune written over the directory) and one model has many names (``/x/tiny``, ``/x/tiny/``, a symlink,
``~/m``). Why not a full sha256: a 1B model's GBs would be read at every worker start.

So, over the files ``from_pretrained`` actually loads (the resolved source: a directory, the GGUF conversion
or unzipped bundle in the cache, a hub snapshot): the config's architecture keys (``ARCHITECTURE``), and for
each weights file its name, size, safetensors header (every tensor's name, dtype, shape, offsets) and 4 KiB
samples at the start, middle and end of every tensor. Training or another
seed changes every tensor it touches, so a fine-tune changes the samples; a few MiB are read per model
(``SAMPLE`` x 3 x tensors). A file that is not safetensors (``pytorch_model.bin``) is sampled at fixed strides.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from worker.quality.head_file import safetensors_header

log = logging.getLogger("triage.quality")
KEY = "model_fingerprint"  # the head metadata key (``head.head_meta``); absent in older and shipped heads

SCHEME = "w1"  # the definition below; a head recording another scheme is compared by name only
SAMPLE = 4096  # bytes read at each of a tensor's start, middle and end
STRIDES = 64  # samples of a file that is not safetensors
# The config keys that say what the weights compute; the rest (transformers_version, _name_or_path, dtype, use_cache,
# keys a newer transformers adds when it converts a GGUF again) change with no weight changed: left out, they
# cannot refuse a head as fitted on "other weights"
ARCHITECTURE = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "hidden_activation",
    "rms_norm_eps",
    "layer_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "position_embedding_type",
    "sliding_window",
)


def weights_fingerprint(directory: str | Path) -> str | None:
    """16 hex chars identifying the model in ``directory`` by content; None when it has no weights files."""
    directory = Path(directory)
    try:
        files = weight_files(directory)
        if not files:
            return None
        h = hashlib.sha256(SCHEME.encode())
        config = directory / "config.json"
        if config.is_file():
            h.update(_config_bytes(config))
        for path in files:
            h.update(f"|{path.name}|{path.stat().st_size}|".encode())
            with open(path, "rb") as f:
                _sample_file(f, path.stat().st_size, h)
    except (OSError, ValueError, AttributeError):  # unreadable, or a broken shard index
        return None  # the name check applies, as for a model with no files
    return h.hexdigest()[:16]


def weight_files(directory: Path) -> list[Path]:
    """The weights files ``from_pretrained`` reads from ``directory``: safetensors before pickles, shards by index."""
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (directory / index).is_file():
            names = json.loads((directory / index).read_text()).get("weight_map", {}).values()
            return [directory / n for n in sorted(set(names))]
        if (directory / single).is_file():
            return [directory / single]
    return sorted(directory.glob("*.safetensors"))


def model_fingerprint(loaded) -> str | None:
    """The fingerprint of a ``LoadedModel``'s source (a hub id: its cached snapshot); None without local files."""
    from worker.engine.sources import hub_snapshot

    source = Path(loaded.source)
    if not source.is_dir():
        try:
            source = hub_snapshot(loaded.source)
        except (OSError, ValueError):
            source = None
    return weights_fingerprint(source) if source is not None else None


def backbone_fingerprint(clf) -> str | None:
    """``clf``'s backbones as a head records them: the LM's fingerprint, ``+`` the joined encoder's (like
    ``model_name``), prefixed by ``SCHEME``; None when one of them has nothing on disk to fingerprint."""
    parts = [model_fingerprint(m) for m in (clf.loaded, clf.encoder) if m is not None]
    return None if None in parts else f"{SCHEME}:" + "+".join(parts)


def model_mismatch(meta: dict, clf) -> str | None:
    """Why a head with metadata ``meta`` was fitted on other backbones than ``clf``'s, or None (``Head.check``).

    With a fingerprint in the head and files to read here, the weights decide: the same weights under another
    spelling of the name are accepted (logged), other weights under the same name refused. Otherwise (older heads,
    the shipped ones, a model with nothing on disk) the model name must match, as before fingerprints."""
    fitted, name = meta.get(KEY), meta.get("model")
    now = backbone_fingerprint(clf) if isinstance(fitted, str) and fitted.startswith(f"{SCHEME}:") else None
    if now is None:
        return None if name == clf.model_name else f"model {name!r} != {clf.model_name!r}"
    if now == fitted:
        if name != clf.model_name:
            log.info("head_model_renamed", extra={"head_model": name, "model": clf.model_name, KEY: now})
        return None
    names = f"{clf.model_name!r}" + ("" if name == clf.model_name else f" (the head's: {name!r})")
    return (
        f"model {names}: the model's weights differ from those the head was fitted on "
        f"(fingerprint {now} here, {fitted} in the head)"
    )


def _config_bytes(config: Path) -> bytes:
    raw = config.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(data, dict):
        return raw
    return json.dumps({k: data[k] for k in ARCHITECTURE if k in data}, sort_keys=True).encode()


def _sample_file(f, size: int, h) -> None:
    header, spans = _safetensors_spans(f, size)
    if spans is None:  # not safetensors: the whole of a small file, samples at fixed strides of a large one
        if size <= STRIDES * SAMPLE:
            h.update(_read(f, 0, size))
            return
        for k in range(STRIDES + 1):
            h.update(_read(f, (size - SAMPLE) * k // STRIDES, SAMPLE))
        return
    h.update(header)  # names, dtypes, shapes, offsets: another architecture or dtype shows here
    data = 8 + len(header)
    for begin, end in spans:
        if end - begin <= 3 * SAMPLE:
            h.update(_read(f, data + begin, end - begin))
            continue
        for at in (begin, begin + (end - begin - SAMPLE) // 2, end - SAMPLE):
            h.update(_read(f, data + at, SAMPLE))


def _safetensors_spans(f, size: int) -> tuple[bytes, list[tuple[int, int]] | None]:
    """The header bytes and every tensor's (begin, end) in the data section, sorted; None if not safetensors."""
    header = safetensors_header(f, size)
    if header is None:
        return b"", None
    try:
        tensors = json.loads(header)
        spans = sorted(
            (int(t["data_offsets"][0]), int(t["data_offsets"][1])) for k, t in tensors.items() if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return b"", None
    return header, spans


def _read(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)
