"""One logging chain for the whole process: structlog events and stdlib records
(rq, redis, transformers) go through the same processors and the same renderer.

Why: ops read one stream of JSON lines (or a readable console when a person
is watching a TTY), never a mix of formats. Secrets (URL passwords in any form,
``password=`` pairs, the configured Redis password itself) are masked in every
rendered line, whoever logged them; tracebacks never show local variables.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog
import structlog.tracebacks

from worker.redact import mask_secrets, mask_url, register_env_secrets  # noqa: F401  (mask_url: re-exported)


def _mask_credentials(_logger: Any, _name: str, event_dict: dict) -> dict:
    for k, v in event_dict.items():
        if isinstance(v, str):
            event_dict[k] = mask_secrets(v)
    return event_dict


class _MaskingFormatter(structlog.stdlib.ProcessorFormatter):
    """The last word on every rendered line (JSON or console, structlog or stdlib): secrets masked,
    whatever field, exception text or traceback they came in."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


def _want_json(fmt: str, stream: TextIO) -> bool:
    if fmt == "json":
        return True
    if fmt == "console":
        return False
    isatty = getattr(stream, "isatty", None)
    return not (isatty and isatty())


def configure_logging(
    fmt: str = "auto", level: str | int = "INFO", stream: TextIO | None = None, static: dict | None = None
) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) through one processor chain.

    ``fmt``: "json" (one object per line), "console" (coloured, for people),
    "auto" (console on a TTY, JSON otherwise). ``static``: fields every line carries unless it
    sets them itself (the worker's ``consumer``: on the lines of libraries and of every thread
    too). Safe to call again (reconfigures).
    """
    stream = stream or sys.stderr
    register_env_secrets()  # TRIAGE_REDIS_URL's password is masked even where only its value shows up
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    fixed = dict(static or {})

    def add_static(_logger: Any, _name: str, event_dict: dict) -> dict:
        for k, v in fixed.items():
            event_dict.setdefault(k, v)
        return event_dict

    shared = [
        structlog.contextvars.merge_contextvars,
        add_static,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        _mask_credentials,
    ]
    if _want_json(fmt, stream):
        renderer: Any = structlog.processors.JSONRenderer()
        # No locals in tracebacks: they could hold settings with credentials.
        final = [
            structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        ]
    else:
        # Plain tracebacks, never rich's "show locals" (it printed a URL password three times).
        renderer = structlog.dev.ConsoleRenderer(
            colors=getattr(stream, "isatty", lambda: False)(), exception_formatter=structlog.dev.plain_traceback
        )
        final = []
    formatter = _MaskingFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_triage", False):
            root.removeHandler(h)
    handler._triage = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    logging.captureWarnings(True)  # py.warnings through the same chain
    global _json_mode
    _json_mode = _want_json(fmt, stream)
    if _json_mode:
        # No progress bars on a JSON stream: transformers/huggingface_hub ones via their switches (below),
        # bare tqdm ones (the GGUF conversion) via tqdm's env defaults, read when tqdm is first imported.
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    route_transformers_logs()


_json_mode = False


def json_mode() -> bool:
    """Whether the last ``configure_logging`` chose JSON lines (then nothing else may be drawn on stderr)."""
    return _json_mode


def route_transformers_logs() -> None:
    """transformers and huggingface_hub log through handlers of their own (a record came out twice:
    raw, and JSON through the root) and draw tqdm bars on stderr; send their records through our
    chain only, and drop the bars when stderr is JSON. Safe to call again; call after importing
    transformers if that happened after ``configure_logging``."""
    if "huggingface_hub" in sys.modules:
        for h in list(logging.getLogger("huggingface_hub").handlers):
            if not getattr(h, "_triage", False):
                logging.getLogger("huggingface_hub").removeHandler(h)
        logging.getLogger("huggingface_hub").propagate = True
        if _json_mode:
            try:
                from huggingface_hub.utils import disable_progress_bars

                disable_progress_bars()
            except ImportError:
                pass
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if _json_mode:
        hf_logging.disable_progress_bar()


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name, **initial)


def event_ms(event: dict) -> int | None:
    """A JSON log event's ``timestamp`` (the TimeStamper's ISO, UTC) in Unix milliseconds; None without one. When
    the worker did something, by its clock: a reader of its log learns of it later (a thread, a pipe)."""
    import datetime as dt

    ts = event.get("timestamp")
    return int(dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1000) if ts else None
