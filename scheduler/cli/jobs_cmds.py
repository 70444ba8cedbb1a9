"""``undertow simulate``, ``undertow worker``, ``undertow beat`` and ``undertow jobs ...``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

jobs_app = typer.Typer(help="The job table, replica leases, and starting the loop.", no_args_is_help=True)


def simulate(
    trace: Path = typer.Option(
        ..., "--trace", help="CSV with window_start_s,total_rate_rps, or a ServeGen client dir."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (the benchmark fields)."),
    warmup_days: int = typer.Option(2, min=1, help="Days that only feed the forecaster's history."),
    capacity_rps: float | None = typer.Option(None, min=0.0, help="A replica's capacity at the SLO (default: sized)."),
    seed: int = typer.Option(0, help="Seed of the within-window burst draws."),
) -> None:
    """Replay a request-rate trace through the planner; compare with a fixed nightly window and an oracle."""
    from scheduler.cli.common import print_json, setup
    from scheduler.planner.trace import TraceError, load_trace
    from scheduler.simulate import simulate as run

    settings = setup()
    try:
        data = load_trace(trace, settings.scheduler.default_cv)
        report = run(data, settings.scheduler, warmup_days=warmup_days, capacity_rps=capacity_rps, seed=seed)
    except TraceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if json_out:
        print_json(report)
        return
    keys = (
        "harvested_gpu_h",
        "oracle_gpu_h",
        "fixed_window_gpu_h",
        "idle_gpu_h",
        "harvest_ratio",
        "fixed_window_ratio",
        "slo_violations",
        "fixed_window_slo_violations",
        "no_borrow_slo_violations",
        "preemptions",
        "p99_preempt_s",
    )
    for key in keys:
        typer.echo(f"{key:28s} {report[key]}")


def worker(
    pool: str = typer.Option("solo", help="Celery pool (solo works on every broker, incl. SQLite)."),
    concurrency: int = typer.Option(1, min=1),
    beat: bool = typer.Option(False, "--beat", help="Also run celery beat inside the worker."),
) -> None:
    """Run a Celery worker of the loop's tasks (exec's ``celery -A scheduler.celery_app worker``)."""
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "scheduler.celery_app",
        "worker",
        f"--pool={pool}",
        f"--concurrency={concurrency}",
        "--loglevel=INFO",
    ]
    if beat:
        home = Path(os.environ.get("UNDERTOW_HOME", ".undertow"))
        args += ["--beat", f"--schedule={home / 'celerybeat-schedule'}"]
    os.execv(sys.executable, args)


def beat() -> None:
    """Run celery beat: the capacity plan and the lease reaper every planning interval."""
    home = Path(os.environ.get("UNDERTOW_HOME", ".undertow"))
    home.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "scheduler.celery_app",
        "beat",
        "--loglevel=INFO",
        f"--schedule={home / 'celerybeat-schedule'}",
    ]
    os.execv(sys.executable, args)


@jobs_app.command("list")
def list_cmd(
    limit: int = typer.Option(50, min=1, max=10_000),
    state: str | None = typer.Option(None, help="Only jobs in this state (STARTED, SUCCESS, FAILURE, ...)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Recent task runs: state, inputs, outputs, timings."""
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from scheduler.tasks.base import list_jobs

    settings = setup()
    jobs = list_jobs(open_database(settings), limit=limit, state=state)
    if json_out:
        print_json({"jobs": jobs})
        return
    for j in jobs:
        typer.echo(
            f"{j['created_at']:%Y-%m-%d %H:%M:%S}  {j['state']:9s} {j['name']:24s} {j['id']}  "
            f"{j['duration_s'] or 0:.1f}s  {j['error'] or ''}"
        )


@jobs_app.command("leases")
def leases_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """Replicas currently borrowed, their holder and expiry."""
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from scheduler.tasks.leases import active_leases

    settings = setup()
    rows = active_leases(open_database(settings))
    if json_out:
        print_json({"leases": rows})
        return
    for r in rows:
        typer.echo(f"{r['replica_id']:24s} {r['pool']:12s} {r['state']:13s} {r['holder']}  expires {r['expires_at']}")


@jobs_app.command("loop")
def loop_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """Enqueue one turn of the loop (collect -> retrain -> RL update -> snapshot -> canary -> promote)."""
    from scheduler.celery_app import make_celery
    from scheduler.cli.common import print_json, setup
    from scheduler.tasks.loop import loop_chain

    settings = setup()
    result = loop_chain(make_celery(settings)).apply_async()
    if json_out:
        print_json({"chain_last_task_id": result.id})
    else:
        typer.echo(result.id)


def register(app: typer.Typer) -> None:
    """Attach ``simulate``, ``worker``, ``beat`` and the ``jobs`` group."""
    app.command("simulate")(simulate)
    app.command("worker")(worker)
    app.command("beat")(beat)
    app.add_typer(jobs_app, name="jobs")
