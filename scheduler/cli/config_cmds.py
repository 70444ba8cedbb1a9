"""``undertow config``: show the resolved settings, or generate the configuration reference."""

from __future__ import annotations

import typer

config_app = typer.Typer(help="Configuration: resolved values and the generated reference.", no_args_is_help=True)


@config_app.command("show")
def show() -> None:
    """Print the resolved configuration as one JSON object (passwords hidden)."""
    from scheduler.cli.common import print_json, setup

    print_json(setup().resolved())


@config_app.command("docs")
def docs(output: str = typer.Option("-", help="File to write, or - for stdout.")) -> None:
    """Write the configuration reference (Markdown) generated from the settings tree."""
    from pathlib import Path

    from scheduler.settings.docs import render_reference

    text = render_reference()
    if output == "-":
        typer.echo(text, nl=False)
    else:
        Path(output).write_text(text)


def register(app: typer.Typer) -> None:
    """Attach the ``config`` group."""
    app.add_typer(config_app, name="config")
