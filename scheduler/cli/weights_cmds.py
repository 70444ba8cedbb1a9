"""Commands of this area (registered on the root undertow app)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach this area's commands to the root app."""
