"""The one logging setup every process of the tree calls once, first thing.

JSON lines off a TTY (what the supervisor reads from a child's pipe), the
console renderer on one. The process's role and ranks are bound in
contextvars, so every line says who wrote it even without the supervisor's
tag. Standard-library loggers (uvicorn, torch) go through the same chain.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

FORMATS = ("auto", "json", "text")


def configure(role: str, *, dp: int | None = None, pp: int | None = None, tp: int | None = None,
              a: int | None = None, fmt: str | None = None, level: str | None = None,
              stream: TextIO | None = None) -> structlog.stdlib.BoundLogger:
    """Set up structlog and stdlib logging for this process and bind who it is.

    `fmt` is auto (console on a TTY, JSON otherwise), json or text; it and
    `level` default to VSUP_LOG_FORMAT and VSUP_LOG_LEVEL. Returns a logger.
    """
    stream = stream or sys.stdout
    fmt = fmt or os.environ.get("VSUP_LOG_FORMAT", "auto")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    level_name = (level or os.environ.get("VSUP_LOG_LEVEL", "info")).upper()
    level_no = logging.getLevelName(level_name)
    if not isinstance(level_no, int):
        raise ValueError(f"log level must be debug, info, warning or error (got {level_name.lower()!r})")

    use_console = fmt == "text" or (fmt == "auto" and stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.dev.ConsoleRenderer(colors=stream.isatty()) if use_console
                else structlog.processors.JSONRenderer())
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([] if use_console else [structlog.processors.format_exc_info]),
                    renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)

    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    ranks = {"a": a, "dp": dp, "pp": pp, "tp": tp}
    structlog.contextvars.bind_contextvars(role=role, pid=os.getpid(),
                                           **{k: v for k, v in ranks.items() if v is not None})
    return structlog.get_logger(role)
