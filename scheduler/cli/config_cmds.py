"""``undertow config``: the resolved settings (secrets masked), the reference, the deployment's secrets."""

from __future__ import annotations

import typer

config_app = typer.Typer(help="Configuration: resolved values and the generated reference.", no_args_is_help=True)


@config_app.command("show")
def show() -> None:
    """Print the resolved configuration as one JSON object (secrets and URL passwords shown as **********)."""
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


@config_app.command("secrets")
def make_secrets(
    output: str = typer.Option("deploy/.env", help="The .env file docker compose reads."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file (rotation: see docs/operating.md)."),
) -> None:
    """Write strong random values for every secret the compose file needs (mode 0600); never prints them."""
    from pathlib import Path

    from scheduler.settings.secrets import write_env

    try:
        values = write_env(Path(output), force=force)
    except FileExistsError:
        typer.echo(f"error: {output} exists; keep it, or pass --force to replace every secret in it", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {len(values)} secrets to {output} (mode 0600): {', '.join(values)}", err=True)


def register(app: typer.Typer) -> None:
    """Attach the ``config`` group."""
    app.add_typer(config_app, name="config")
