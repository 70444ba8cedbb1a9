"""``undertow users``: forget a user, list the forgotten, and run the retention sweep by hand."""

from __future__ import annotations

from typing import Any

import typer

users_app = typer.Typer(help="Users' data: forget a user, list the forgotten, enforce retention.", no_args_is_help=True)


@users_app.command("forget")
def forget(
    user: str = typer.Argument(..., help="The user id as the telemetry carries it."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Delete the user's sessions, signals and dead letters; drop their later events at ingest; flag the
    reward-model and policy versions trained on their rows."""
    from scheduler.cli.common import print_json, setup
    from scheduler.privacy import forget as run
    from scheduler.runtime import open_database

    if not user or len(user) > 128:
        raise typer.BadParameter("a user id is 1 to 128 characters")
    out = run(open_database(setup()), user, "cli")
    if json_out:
        print_json(out)
        return
    deleted = ", ".join(f"{n} {table}" for table, n in out["deleted"].items())
    typer.echo(f"forgot user {out['user_hash'][:12]}…: deleted {deleted}", err=True)
    for kind, versions in out["flagged"].items():
        if versions:
            typer.echo(f"flagged {kind} trained on their data: {', '.join(versions)}", err=True)


@users_app.command("forgotten")
def forgotten(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List the forgotten users (id hashes only) and the late events dropped for each."""
    from ingest.db import session_factory
    from ingest.forget import list_forgotten
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    with session_factory(open_database(setup()))() as session:
        items: list[dict[str, Any]] = [
            {
                "user_hash": r.user_hash,
                "forgotten_at": r.forgotten_at,
                "requested_by": r.requested_by,
                "dropped_events": r.dropped_events,
                "flagged": r.flagged,
            }
            for r in list_forgotten(session)
        ]
    if json_out:
        print_json({"forgotten": items})
        return
    for item in items:
        typer.echo(f"{item['user_hash'][:16]}…  {item['forgotten_at']}  dropped {item['dropped_events']}")


@users_app.command("retention")
def retention(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Delete telemetry and audit entries older than their retention settings now (the beat job does it hourly)."""
    from scheduler.cli.common import print_json, setup
    from scheduler.privacy import enforce_retention
    from scheduler.runtime import open_database

    settings = setup()
    out = enforce_retention(open_database(settings), settings)
    if json_out:
        print_json(out)
    else:
        typer.echo(f"retention: telemetry {out['telemetry']}, audit {out['audit']}", err=True)


def register(app: typer.Typer) -> None:
    """Attach the ``users`` group."""
    app.add_typer(users_app, name="users")
