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
    from scheduler.planner.simulate import simulate as run
    from scheduler.planner.trace import TraceError, load_trace

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
    """Run a Celery worker of the loop's tasks (exec's ``celery -A scheduler.loop.app worker``)."""
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "scheduler.loop.app",
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
        "scheduler.loop.app",
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
    """Recent jobs: kind, state, the state they carry, timings."""
    from scheduler.cli.common import print_json, setup
    from scheduler.loop.jobs import list_jobs, reap_lost
    from scheduler.runtime import open_database

    settings = setup()
    engine = open_database(settings)
    reap_lost(engine, settings.scheduler.job_lost_after_s)
    jobs = list_jobs(engine, limit=limit, state=state)
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
    from scheduler.loop.leases import active_leases
    from scheduler.runtime import open_database

    settings = setup()
    rows = active_leases(open_database(settings))
    if json_out:
        print_json({"leases": rows})
        return
    for r in rows:
        typer.echo(f"{r['replica_id']:24s} {r['pool']:12s} {r['state']:13s} {r['holder']}  expires {r['expires_at']}")


@jobs_app.command("loop")
def loop_cmd(
    evaluate: bool = typer.Option(False, help="Append the held-out evaluation of the new version."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Queue one turn of the loop (collect -> retrain -> RL update -> snapshot -> rollout)."""
    from scheduler.cli.common import print_json, setup
    from scheduler.loop.state import LoopState
    from scheduler.loop.submit import new_job_id, submit
    from scheduler.runtime import open_database

    settings = setup()
    job_id = submit(open_database(settings), settings, LoopState(run_id=new_job_id(), evaluate=evaluate))
    if json_out:
        print_json({"job_id": job_id})
    else:
        typer.echo(job_id)


@jobs_app.command("cancel")
def cancel_cmd(job_id: str, json_out: bool = typer.Option(False, "--json")) -> None:
    """Cancel a queued or running job (no step of it starts afterwards; a training stops at its next step)."""
    from scheduler.cli.common import print_json, setup
    from scheduler.loop.submit import cancel
    from scheduler.runtime import open_database

    settings = setup()
    found = cancel(open_database(settings), settings, job_id, "cli")
    if found is None:
        raise SystemExit(f"no job {job_id!r}; list them with `undertow jobs list`")
    row, cancelled = found
    if json_out:
        print_json({"job_id": job_id, "state": row.state, "cancelled": cancelled})
    elif cancelled:
        typer.echo(f"{job_id} cancelled")
    else:
        raise SystemExit(f"job {job_id} already finished ({row.state}); nothing to cancel")


def register(app: typer.Typer) -> None:
    """Attach ``simulate``, ``worker``, ``beat`` and the ``jobs`` group."""
    app.command("simulate")(simulate)
    app.command("worker")(worker)
    app.command("beat")(beat)
    app.add_typer(jobs_app, name="jobs")
