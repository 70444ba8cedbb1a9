"""``undertow rewards``: train reward models from the database, score sessions, list versions."""

from __future__ import annotations

from pathlib import Path

import typer

rewards_app = typer.Typer(help="Reward models: train, score, list versions.", no_args_is_help=True)


@rewards_app.command("train")
def train(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object with the new version and its metrics."),
    backend: str | None = typer.Option(None, help="Override the backend: sklearn or torch."),
) -> None:
    """Train, evaluate on a time-ordered hold-out, register, and promote if better than the current version."""
    from reward_models.train import TrainingDataError, train_reward_models
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    config = settings.rewards if backend is None else settings.rewards.model_copy(update={"backend": backend})
    if config.backend not in ("sklearn", "torch"):
        raise typer.BadParameter(f"unknown backend {config.backend!r}; use sklearn or torch", param_hint="--backend")
    engine = open_database(settings)
    resolved = settings.model_copy(update={"rewards": config}).resolved()  # secrets masked: it is stored
    try:
        report = train_reward_models(engine, config, settings.home, resolved_config=resolved)
    except TrainingDataError as exc:
        typer.echo(f"error: {exc}", err=True)
        if json_out:
            print_json({"error": str(exc), "versions": []})
        raise typer.Exit(2) from None
    if json_out:
        print_json(report.to_json())
    else:
        typer.echo(f"{report.version}: {report.status} ({report.reason}); primary metric {report.primary_metric}")


@rewards_app.command("score")
def score(
    input_file: Path = typer.Option(..., "--input", help="JSONL of session.completed envelopes ('-' for stdin)."),
    version: str = typer.Option("latest", "--version", help="Version id, or 'latest' (the promoted one)."),
) -> None:
    """Print JSONL ``{"session_id": ..., "reward": float}`` in input order."""
    import json
    import sys

    from reward_models.api import load_scorer
    from reward_models.registry import CorruptArtifact, UnknownVersion
    from reward_models.scoring_input import read_envelopes
    from scheduler.cli.common import setup
    from scheduler.runtime import open_database

    settings = setup()
    engine = open_database(settings)
    try:
        scorer = load_scorer(engine, version)
    except (UnknownVersion, CorruptArtifact) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    stream = sys.stdin if str(input_file) == "-" else None
    if stream is None and not input_file.exists():
        typer.echo(f"error: input file {input_file} does not exist", err=True)
        raise typer.Exit(2)
    try:
        envelopes = read_envelopes(stream if stream is not None else input_file.open(encoding="utf-8"))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    rewards = scorer.score(envelopes)
    for env, reward in zip(envelopes, rewards, strict=True):
        sys.stdout.write(json.dumps({"session_id": env["session_id"], "reward": float(reward)}) + "\n")
    sys.stdout.flush()


@rewards_app.command("list")
def list_versions(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List reward-model versions, newest first."""
    from reward_models.registry import list_versions as do_list
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    rows = do_list(open_database(settings))
    if json_out:
        print_json({"versions": rows})
        return
    for r in rows:
        metric = "-" if r["primary_metric"] is None else f"{r['primary_metric']:.4f}"
        typer.echo(
            f"{r['version']}  {r['status']:<9}  {r['backend']:<7}  primary={metric}  "
            f"labeled={r['n_labeled']}  {r['created_at']}"
        )


def register(app: typer.Typer) -> None:
    """Attach the ``rewards`` group."""
    app.add_typer(rewards_app, name="rewards")
