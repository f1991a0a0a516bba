"""Confusion-matrix PNGs (matplotlib, headless), one panel per evaluated method."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def plot_confusions(panels: Sequence[tuple[str, list[str], list[list[int]]]], path: str | Path) -> None:
    """``panels``: (title, labels, confusion [J, J+1]) each; rows normalised to recall so
    rare labels stay readable, raw counts printed in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    if n == 0:
        raise ValueError("nothing to plot")
    j = max(len(labels) for _, labels, _ in panels)
    cell = 0.28 if j > 20 else 0.55
    side = max(4.0, cell * j + 2.0)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, (title, labels, cm) in zip(axes.flat, panels):
        counts = np.asarray(cm, dtype=float)
        if counts[:, -1].sum() == 0:  # no fallback/unknown predictions: drop that column
            counts = counts[:, :-1]
        xlabels = list(labels) + (["(other)"] if counts.shape[1] > len(labels) else [])
        norm = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        small = len(labels) > 20
        ax.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=5 if small else 8)
        ax.set_yticks(range(len(labels)), labels, fontsize=5 if small else 8)
        if not small:
            for r in range(counts.shape[0]):
                for c in range(counts.shape[1]):
                    if counts[r, c]:
                        ax.text(
                            c,
                            r,
                            int(counts[r, c]),
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="white" if norm[r, c] > 0.5 else "black",
                        )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
