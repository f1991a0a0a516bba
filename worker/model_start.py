"""The long-running workers' classifier, ready to serve: built, warmed, and what that took.

Why one function: the stream worker and the RQ batch worker serve the same passes, so both
must start the same way. A fresh worker's first window should pay neither for lazy init
(one small pass here does that) nor for CUDA graph captures of the full-pass shapes
(``engine.graph_warmup``, when ``TRIAGE_CUDA_GRAPH_WARM_UP``). Both log the same start-up facts.
"""

from __future__ import annotations

import time
from typing import Any


def start_model(settings, log) -> tuple[Any, dict[str, Any]]:
    """(classifier, facts for the ready log line: load_ms, torch_threads, tokenize_threads, pass_overhead_tokens,
    cuda_graphs_warm_up)."""
    from worker.assemble import build_classifier
    from worker.engine.device import tokenize_threads
    from worker.engine.types import InvalidTicket
    from worker.logs import route_transformers_logs

    route_transformers_logs()
    t0 = time.perf_counter()
    clf = build_classifier(settings)
    # the first real batch should not pay for lazy init; "x" where the sentence is over a tight token limit with
    # truncation off (a warm-up refused like a ticket stopped the worker with a traceback)
    texts = ["warm-up ticket: the first real batch should not pay for lazy init", "x"]
    clf.classify([next(p for p in clf.prepare(texts) if not isinstance(p, InvalidTicket))])
    graphs = warm_graphs(clf, log) if settings.cuda_graph_warm_up else None
    return clf, {
        "load_ms": round((time.perf_counter() - t0) * 1000),
        "torch_threads": _torch_threads(),
        "tokenize_threads": tokenize_threads(),
        "pass_overhead_tokens": clf.options.pass_overhead_tokens,  # TRIAGE_PASS_OVERHEAD_TOKENS=auto: measured
        "cuda_graphs_warm_up": graphs,
    }


def warm_graphs(clf, log) -> dict | None:
    """Capture the full-pass CUDA graphs now (None: no graphs here). Only a speed-up: a failure is logged and
    the worker starts anyway, capturing shapes when they come back as it would without the warm-up."""
    from worker.engine import graph_warmup

    try:
        return graph_warmup.warm_up(clf)
    except Exception as e:  # noqa: BLE001
        log.warning("cuda_graph_warm_up_failed", error=f"{type(e).__name__}: {e}", action="capturing as shapes come")
        return None


def _torch_threads() -> int:
    import torch  # already loaded with the model

    return torch.get_num_threads()
