"""Structured logging to stderr (console renderer, or JSON lines with ``UNDERTOW_LOG_JSON=1``)."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """A file-like object that writes to whatever ``sys.stderr`` is at the time of the write."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "INFO", json_lines: bool = False) -> None:
    """Route structlog and stdlib logging to stderr at ``level``; stdout stays for command output."""
    lvl = logging.getLevelName(level.upper())
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s", force=True)
    for noisy in ("kafka", "alembic", "httpx", "urllib3", "celery", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(lvl, logging.WARNING))
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
