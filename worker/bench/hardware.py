"""What ran where: the machine, device and library versions of a run (the bench JSON's ``hardware``)."""

from __future__ import annotations

import os
import platform


def hardware(clf) -> dict:
    """The machine, device and library versions a run measured (the JSON's ``hardware``)."""
    import torch
    import transformers

    from worker.engine.device import tokenize_threads

    dev = clf.device
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "tokenize_threads": tokenize_threads(),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "dtype": clf.dtype_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
