"""``undertow policy``: warm-up to v0, offline RL versions, held-out evaluation, version list."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from scheduler.settings import Settings

policy_app = typer.Typer(help="The MoE policy: warm-up, RL versions, evaluation.", no_args_is_help=True)


def checkpoints_root(settings: Settings) -> Path:
    """Where version checkpoints live (a relative ``checkpoints_dir`` is under the Undertow home)."""
    root = Path(settings.policy.checkpoints_dir)
    return root if root.is_absolute() else settings.home / root


def _eval_config(samples: int, per_tier: int):  # type: ignore[no-untyped-def]
    from policy.evaluate import EvalConfig

    return EvalConfig(samples_per_task=samples, per_tier=per_tier)


@policy_app.command("warmup")
def warmup_cmd(
    steps: int = typer.Option(0, help="Warm-up optimizer steps (0: the configured sft_steps)."),
    samples: int = typer.Option(4, help="Evaluation samples per held-out task."),
    per_tier: int = typer.Option(32, help="Held-out tasks per tier in the evaluation."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Train policy v0 by supervised warm-up on the task family and record it."""
    from policy.pipeline import run_warmup
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    engine = open_database(settings)
    row = run_warmup(
        settings.policy,
        checkpoints_root(settings),
        engine,
        steps=steps or None,
        eval_cfg=_eval_config(samples, per_tier),
    )
    if as_json:
        print_json(row)
    else:
        typer.echo(f"{row['version']}: keep rate {row['metrics'].get('eval/keep_rate', 0):.3f} at {row['checkpoint']}")


def _launch(nproc: int, args: list[str]) -> int:
    """Run ``undertow policy train ARGS`` in ``nproc`` processes under torchrun; relay rank 0's stdout."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "scheduler.cli", "policy", "train", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    return proc.returncode


@policy_app.command("train")
def train_cmd(
    versions: int = typer.Option(1, help="How many successive versions to train."),
    steps: int = typer.Option(0, help="RL steps per version (0: the configured rl_steps_per_version)."),
    samples: int = typer.Option(4, help="Evaluation samples per held-out task."),
    per_tier: int = typer.Option(32, help="Held-out tasks per tier in the evaluation."),
    nproc: int = typer.Option(
        1, "--nproc", help="Trainer processes on this machine (launches torchrun; see policy.parallel)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Offline RL on the task family from the latest version; records each new version.

    With --nproc N (or under torchrun) N processes train one model (FSDP: policy.parallel); rank 0 writes.
    """
    if versions < 1:
        raise typer.BadParameter("--versions must be at least 1")
    if nproc < 1:
        raise typer.BadParameter("--nproc must be at least 1")
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        args = [f"--versions={versions}", f"--steps={steps}", f"--samples={samples}", f"--per-tier={per_tier}"]
        code = _launch(nproc, [*args, "--json"] if as_json else args)
        if code != 0:
            raise typer.Exit(code)
        return

    from policy.distributed import barrier, init_from_env, shutdown, train_device
    from policy.pipeline import run_rl_versions
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    rank, _ = init_from_env(train_device(settings.policy.device))
    if rank == 0:  # rank 0 brings the schema up to date before the others open the database
        engine = open_database(settings)
    barrier()
    if rank != 0:
        engine = open_database(settings)
    try:
        rows = run_rl_versions(
            settings.policy,
            checkpoints_root(settings),
            engine,
            versions=versions,
            steps=steps or None,
            eval_cfg=_eval_config(samples, per_tier),
        )
    finally:
        shutdown()
    if rank != 0:
        return
    if as_json:
        print_json({"versions": rows})
    else:
        for row in rows:
            typer.echo(f"{row['version']}: keep rate {row['metrics'].get('eval/keep_rate', 0):.3f}")


@policy_app.command("eval")
def eval_cmd(
    version: str = typer.Option("latest", help="Version id (e.g. v0003) or 'latest'."),
    samples: int = typer.Option(4, help="Evaluation samples per held-out task."),
    per_tier: int = typer.Option(32, help="Held-out tasks per tier."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Held-out pass-and-keep rate of a recorded version."""
    from policy.evaluate import evaluate
    from policy.model import load_checkpoint
    from policy.versions import latest_version, list_versions
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    engine = open_database(settings)
    rows = list_versions(engine)
    row = latest_version(engine) if version == "latest" else next((r for r in rows if r.version_id == version), None)
    if row is None:
        known = ", ".join(r.version_id for r in rows) or "none (run `undertow policy warmup`)"
        raise typer.BadParameter(f"no policy version {version!r}; known versions: {known}")
    model, tokenizer = load_checkpoint(row.checkpoint_path)
    metrics = evaluate(model, tokenizer, _eval_config(samples, per_tier))
    if as_json:
        print_json({"version": row.version_id, **metrics})
    else:
        typer.echo(
            f"{row.version_id}: keep rate {metrics['eval/keep_rate']:.3f}, pass rate {metrics['eval/pass_rate']:.3f}"
        )


@policy_app.command("versions")
def versions_cmd(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List recorded policy versions, oldest first."""
    from policy.versions import list_versions
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    rows = list_versions(open_database(settings))
    items = [
        {"version": r.version_id, "parent": r.parent_id, "step": r.step, "keep_rate": r.metrics.get("eval/keep_rate")}
        for r in rows
    ]
    if as_json:
        print_json({"versions": items})
    else:
        for item in items:
            typer.echo(f"{item['version']}  parent={item['parent']}  step={item['step']}  keep={item['keep_rate']}")


def register(app: typer.Typer) -> None:
    """Attach the ``policy`` group."""
    app.add_typer(policy_app, name="policy")
