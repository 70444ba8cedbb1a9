"""``undertow demo``: the main job on the embedded stack.

Stage 1 (telemetry): start the stack (embedded broker, migrated database, ingest consumer),
replay a day of realistic telemetry whose arrival times follow the ServeGen production trace,
compressed into ``--minutes`` of wall time, through Kafka into the database, and print the stats.
"""

from __future__ import annotations

import typer


def demo(
    minutes: float = typer.Option(1.0, min=0.05, help="Wall-clock minutes the replayed day is compressed into."),
    requests: int = typer.Option(600, min=1, help="User requests in the replayed day (K-candidate groups count once)."),
    seed: int = typer.Option(0, help="Seed of the synthetic telemetry and its hidden quality."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the results."),
    keep_running: bool = typer.Option(False, "--keep-running", help="Keep broker and consumer up until Ctrl-C."),
) -> None:
    """Replay realistic telemetry through Kafka into the database and print what was stored."""
    from scheduler.cli.common import print_json, setup
    from scheduler.demo_ingest import run_ingest_stage

    settings = setup()
    result = run_ingest_stage(settings, minutes=minutes, requests=requests, seed=seed, keep_running=keep_running)
    if as_json:
        print_json(result)
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Undertow demo: telemetry ingest ({result['seconds']:.1f} s)")
        table.add_column("what")
        table.add_column("count", justify="right")
        for kind, n in result["stats"]["events"].items():
            table.add_row(kind, str(n))
        for key in ("sessions", "duplicates", "dead_letters"):
            table.add_row(key, str(result["stats"][key]), style="bold")
        table.add_row("produced this run", str(result["produced"]))
        table.add_row("signals waiting for their session", str(sum(result["waiting_for_session"].values())))
        Console().print(table)


def register(app: typer.Typer) -> None:
    """Attach ``demo``."""
    app.command("demo")(demo)
