"""The ``--model`` / ``--dtype`` / ``--device`` flags of the offline commands (eval, fit, verify), and their settings.

Each flag overrides its ``TRIAGE_*`` variable; everything else comes from the environment,
as for the worker, so a command measures the engine the worker would run.
"""

from __future__ import annotations

import argparse


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="override TRIAGE_MODEL")
    p.add_argument("--dtype", choices=["auto", "fp16", "bf16", "fp32"], default=None, help="override TRIAGE_DTYPE")
    p.add_argument("--device", default=None, help="override TRIAGE_DEVICE")
    p.add_argument(
        "--encoder", default=None, help="override TRIAGE_ENCODER (joined LM + encoder features, e.g. bundled:minilm)"
    )
    p.add_argument("--head-prompt", choices=["labels", "task"], default=None, help="override TRIAGE_HEAD_PROMPT")


def settings_from_args(args: argparse.Namespace, *, scorer: bool = False):
    """``Settings`` from the environment with the model flags applied, and logging set up from them.

    Invalid settings, a task that cannot be read (TRIAGE_TASK_FILE, TRIAGE_LABELS), and a model or encoder that
    cannot be found (or is the wrong kind) end the command as they end ``check`` and ``run`` (``preflight``): one
    line each naming the flag or env var, exit 2, before torch loads. ``scorer``: the command classifies with the
    scorer the worker would use (``verify``), so TRIAGE_HEAD_PATH and TRIAGE_SCORER are checked too; ``eval`` and
    ``fit`` measure and fit heads and do not use them.
    """
    from worker import preflight
    from worker.logs import configure_logging

    keys = ("model", "dtype", "device", "encoder", "head_prompt")
    overrides = {k: getattr(args, k, None) for k in keys}
    prog = f"triage-worker {getattr(args, 'command', None) or ''}".strip()
    settings = preflight.settings_or_exit(prog, check_redis_url=False, **overrides)
    named = {k: f"--{k}" if overrides[k] is not None else f"TRIAGE_{k.upper()}" for k in ("model", "encoder")}
    # `fit --default-head` fits the shipped head on the built-in task, whatever TRIAGE_TASK_FILE / TRIAGE_LABELS say
    task = not getattr(args, "default_head", False)
    problems = preflight.classifier_problems(settings, names=named, task=task, scorer=scorer)
    preflight.exit_on(prog, problems)
    configure_logging(settings.log_format, settings.log_level)
    return settings
