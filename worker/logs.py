"""One logging chain for the whole process: structlog events and stdlib records
(rq, redis, transformers) go through the same processors and the same renderer.

Why: ops read one stream of JSON lines (or a readable console when a person
is watching a TTY), never a mix of formats. Passwords in URLs are masked in
every value before rendering, whoever logged them.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, TextIO

import structlog
import structlog.tracebacks

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>[^@/\s]+)@", re.I)


def mask_url(text: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host`` (anything else unchanged)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


def _mask_credentials(_logger: Any, _name: str, event_dict: dict) -> dict:
    for k, v in event_dict.items():
        if isinstance(v, str) and "@" in v and "://" in v:
            event_dict[k] = mask_url(v)
    return event_dict


def _want_json(fmt: str, stream: TextIO) -> bool:
    if fmt == "json":
        return True
    if fmt == "console":
        return False
    isatty = getattr(stream, "isatty", None)
    return not (isatty and isatty())


def configure_logging(fmt: str = "auto", level: str | int = "INFO", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) through one processor chain.

    ``fmt``: "json" (one object per line), "console" (coloured, for people),
    "auto" (console on a TTY, JSON otherwise). Safe to call again (reconfigures).
    """
    stream = stream or sys.stderr
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        _mask_credentials,
    ]
    if _want_json(fmt, stream):
        renderer: Any = structlog.processors.JSONRenderer()
        # No locals in tracebacks: they could hold settings with credentials.
        final = [structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=getattr(stream, "isatty", lambda: False)())
        final = []
    formatter = structlog.stdlib.ProcessorFormatter(
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
    logging.captureWarnings(True)
    global _json_mode
    _json_mode = _want_json(fmt, stream)
    if "transformers" in sys.modules:
        route_transformers_logs()


_json_mode = False


def route_transformers_logs() -> None:
    """transformers logs through its own handler (propagate=False) and draws tqdm bars on stderr;
    send its records through our chain instead, and drop the bars when stderr is JSON.
    Call after importing transformers if that happened after ``configure_logging``."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if _json_mode:
        hf_logging.disable_progress_bar()
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name, **initial)
