"""Helpers every command uses: load settings, configure logging, print one JSON object last."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.settings import Settings


def setup(**overrides: Any) -> Settings:
    """Load settings and configure logging to stderr."""
    from scheduler.runtime.logs import configure_logging
    from scheduler.settings import load_settings

    settings = load_settings(**overrides)
    configure_logging(settings.log_level, settings.log_json)
    return settings


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout (the ``--json`` contract)."""
    sys.stdout.write(json.dumps(obj, default=str, sort_keys=False) + "\n")
    sys.stdout.flush()
