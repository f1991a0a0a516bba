"""Heads shipped with the package: the worker's default scorer for the built-in support task.

``support-<model>.safetensors`` is fitted by ``make default-head`` (``triage-worker fit --default-head``)
on the project's labelled support tickets; its metadata records the data files and their hashes,
the model, the prompt hash, the seed, the command and the measured figures (docs/quality.md).
"""

from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent

# TRIAGE_MODEL value -> the shipped support head fitted for it
SHIPPED = {
    "bundled:smollm2": "support-smollm2.safetensors",
    "bundled:minilm": "support-minilm.safetensors",
    "bundled:smollm2+bundled:minilm": "support-smollm2-minilm.safetensors",
}


def shipped_head_path(model_name: str) -> Path | None:
    name = SHIPPED.get(model_name)
    path = HEADS_DIR / name if name else None
    return path if path is not None and path.is_file() else None
