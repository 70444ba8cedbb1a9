"""``undertow api`` serves the control plane and dashboards; ``undertow tokens`` manages API tokens."""

from __future__ import annotations

import typer

tokens_app = typer.Typer(help="API tokens: create (shown once), list, revoke.", no_args_is_help=True)


def api(
    host: str | None = typer.Option(None, help="Interface to bind (default: api.host, 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default: api.port, 8200)."),
) -> None:
    """Serve the control-plane API (/api/v1) and the dashboards (/)."""
    import uvicorn

    from scheduler.api.app import create_app
    from scheduler.cli.common import setup

    settings = setup()
    app = create_app(settings)
    bind_host, bind_port = host or settings.api.host, port or settings.api.port
    typer.echo(
        f"control plane on http://{bind_host}:{bind_port}/ (log in with a token from `undertow tokens create`)",
        err=True,
    )
    # proxy_headers off: the app honours X-Forwarded-For from ``api.trusted_proxies`` only (uvicorn's own
    # default would trust it from 127.0.0.1).
    uvicorn.run(
        app,
        host=bind_host,
        port=bind_port,
        log_level=settings.log_level.lower(),
        access_log=False,
        proxy_headers=False,
    )


@tokens_app.command("create")
def create(
    name: str | None = typer.Option(None, "--name", help="Who uses it (shown in the audit log); default: generated."),
    role: str = typer.Option("viewer", "--role", help="viewer (reads) or operator (also triggers and deploys)."),
    expires_days: float | None = typer.Option(
        None, "--expires-days", help="Lifetime in days (default: api.token_ttl_days; 0: never expires)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Create a token and print it once; only its hash is stored."""
    import secrets

    from scheduler.api.auth import create_token
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    try:
        ttl = settings.api.token_ttl_days if expires_days is None else expires_days
        row, token = create_token(open_database(settings), name or f"{role}-{secrets.token_hex(3)}", role, ttl)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if json_out:
        print_json({"name": row.name, "role": row.role, "token": token, "expires_at": row.expires_at})
    else:
        typer.echo(f"created {row.role} token {row.name!r}; store it now, it is not shown again:", err=True)
        typer.echo(token)


@tokens_app.command("list")
def list_(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List tokens (names, roles, prefixes; never the tokens)."""
    from scheduler.api.auth import list_tokens
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    rows = list_tokens(open_database(setup()))
    items = [
        {
            "name": r.name,
            "role": r.role,
            "prefix": r.prefix,
            "created_at": r.created_at,
            "expires_at": r.expires_at,
            "last_used_at": r.last_used_at,
            "revoked": r.revoked_at is not None,
        }
        for r in rows
    ]
    if json_out:
        print_json({"tokens": items})
    else:
        for item in items:
            typer.echo(
                f"{item['name']:<24} {item['role']:<9} {item['prefix']}…  {'revoked' if item['revoked'] else ''}"
            )


@tokens_app.command("revoke")
def revoke(name: str = typer.Argument(..., help="Name of the token to revoke.")) -> None:
    """Revoke a token: it stops working at once."""
    from scheduler.api.auth import revoke_token
    from scheduler.cli.common import setup
    from scheduler.runtime import open_database

    if not revoke_token(open_database(setup()), name):
        raise typer.BadParameter(f"no active token named {name!r}; see `undertow tokens list`")
    typer.echo(f"revoked {name!r}", err=True)


def register(app: typer.Typer) -> None:
    """Attach ``api`` and the ``tokens`` group."""
    app.command("api")(api)
    app.add_typer(tokens_app, name="tokens")
