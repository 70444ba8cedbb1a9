"""``undertow gateway-keys``: API keys of the gateway's client integrations (create, list, revoke)."""

from __future__ import annotations

import typer

keys_app = typer.Typer(
    help="Gateway API keys, one per client integration: create (shown once), list, revoke.", no_args_is_help=True
)


@keys_app.command("create")
def create(
    name: str = typer.Argument(..., help="The client integration (an editor plugin, an agent runner)."),
    scope: list[str] = typer.Option(["serve"], "--scope", help="serve (completions, signals) and/or metrics."),
    user: str | None = typer.Option(None, "--user", help="Bind the key to one user: it speaks for them only."),
    rate: float | None = typer.Option(None, "--rate", help="Requests per second (default: the gateway's)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Create a key and print it once; only its hash is stored. The gateway accepts it within
    ``serving.gateway.key_refresh_s``."""
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.keys import create_key, describe

    try:
        row, key = create_key(open_database(setup()), name, tuple(scope), user, rate)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if json_out:
        print_json({**describe(row), "key": key})
    else:
        typer.echo(
            f"created gateway key {row.name!r} ({', '.join(row.scopes)}); store it now, it is not shown again:",
            err=True,
        )
        typer.echo(key)


@keys_app.command("list")
def list_(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List keys (names, scopes, users, prefixes; never the keys)."""
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.keys import describe, list_keys

    items = [describe(r) for r in list_keys(open_database(setup()))]
    if json_out:
        print_json({"keys": items})
        return
    for item in items:
        scopes = ",".join(item["scopes"])  # type: ignore[arg-type]
        revoked = "revoked" if item["revoked_at"] else ""
        typer.echo(f"{item['name']:<28} {scopes:<14} {item['user_id'] or '':<16} {item['prefix']}…  {revoked}")


@keys_app.command("revoke")
def revoke(name: str = typer.Argument(..., help="Name of the key to revoke.")) -> None:
    """Revoke a key: the gateway refuses it within ``serving.gateway.key_refresh_s``."""
    from scheduler.cli.common import setup
    from scheduler.runtime import open_database
    from serving.keys import revoke_key

    if not revoke_key(open_database(setup()), name):
        raise typer.BadParameter(f"no active gateway key named {name!r}; see `undertow gateway-keys list`")
    typer.echo(f"revoked {name!r}", err=True)


def register(app: typer.Typer) -> None:
    """Attach the ``gateway-keys`` group."""
    app.add_typer(keys_app, name="gateway-keys")
