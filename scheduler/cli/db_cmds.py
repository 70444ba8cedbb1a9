"""``undertow db``: migrate the database explicitly, or show where it stands."""

from __future__ import annotations

import typer

db_app = typer.Typer(help="Database schema: upgrade, downgrade, current revision.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade(revision: str = typer.Argument("heads", help="Target revision (default: every branch head).")) -> None:
    """Migrate the database to the latest schema."""
    from ingest.db import upgrade as do_upgrade
    from scheduler.cli.common import setup

    settings = setup()
    do_upgrade(settings.resolved_database_url, revision)
    typer.echo(f"database at {revision}: {settings.resolved()['database_url']}", err=True)


@db_app.command("downgrade")
def downgrade(revision: str = typer.Argument(..., help="Target revision, e.g. 'base'.")) -> None:
    """Migrate the database down (destroys the data of the dropped tables)."""
    from ingest.db import downgrade as do_downgrade
    from scheduler.cli.common import setup

    settings = setup()
    do_downgrade(settings.resolved_database_url, revision)


@db_app.command("status")
def status() -> None:
    """Print the migrations the database still lacks (none: up to date)."""
    from ingest.db import make_engine, pending_heads
    from scheduler.cli.common import print_json, setup

    settings = setup()
    missing = sorted(pending_heads(make_engine(settings.resolved_database_url)))
    print_json({"up_to_date": not missing, "missing": missing})


def register(app: typer.Typer) -> None:
    """Attach the ``db`` group."""
    app.add_typer(db_app, name="db")
