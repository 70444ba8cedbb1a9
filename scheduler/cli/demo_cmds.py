"""``undertow demo``: the closed loop end to end on one machine.

By default: the embedded stack, three CPU engine replicas serving v0, the gateway, the API with
dashboards and a Celery worker; simulated developers replay a day of the ServeGen trace through
the gateway and the loop trains, rolls out and gates new versions by itself (see
:mod:`scheduler.demo.run`). ``--stage ingest`` runs only stage 1: realistic telemetry replayed
through Kafka into the database, with its stats.
"""

from __future__ import annotations

import typer


def demo(
    minutes: float = typer.Option(
        None, min=0.05, help="Wall-clock minutes of the replayed day (loop: 6, ingest stage: 1)."
    ),
    requests: int = typer.Option(
        None, min=1, help="User requests of synthetic telemetry (600); only for the ingest stage, which it implies."
    ),
    seed: int = typer.Option(0, help="Seed of the developers, arrivals and trainer (ingest stage: telemetry)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the results."),
    keep_running: bool = typer.Option(False, "--keep-running", help="Keep the stack up until Ctrl-C."),
    stage: str = typer.Option(
        None,
        help="loop (the closed loop; default) or ingest (telemetry into the database only; default with --requests).",
    ),
    rps: float = typer.Option(0.6, min=0.01, help="Loop: mean request rate of the developers (wall clock)."),
    drill: bool = typer.Option(True, help="Loop: run the gate drill (a deliberately destructive update)."),
    population: bool = typer.Option(
        True,
        "--population/--deterministic",
        help="Loop: users drawn from a population (different tastes; partial, noisy, late signals; churn; bad "
        "actors), scored by their true utility (default); --deterministic: developers who follow the checker's rule.",
    ),
) -> None:
    """Run the demo and print what it measured (tables on the terminal, or one JSON object)."""
    from scheduler.cli.common import print_json, setup

    settings = setup()
    stage = stage or ("ingest" if requests is not None else "loop")
    if stage == "ingest":
        _ingest(settings, minutes or 1.0, requests or 600, seed, as_json, keep_running)
        return
    if stage != "loop":
        raise typer.BadParameter(f"unknown stage {stage!r}: use loop or ingest")
    from scheduler.demo.report import print_report
    from scheduler.demo.run import DemoOptions, run_demo

    opts = DemoOptions(
        minutes=minutes or 6.0, seed=seed, keep_running=keep_running, mean_rps=rps, drill=drill, population=population
    )
    report = run_demo(settings, opts)
    if as_json:
        print_json(report)
    else:
        print_report(report)


def _ingest(settings: object, minutes: float, requests: int, seed: int, as_json: bool, keep_running: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from scheduler.cli.common import print_json
    from scheduler.demo.replay import run_ingest_stage

    result = run_ingest_stage(settings, minutes=minutes, requests=requests, seed=seed, keep_running=keep_running)  # type: ignore[arg-type]
    if as_json:
        print_json(result)
        return
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
