"""``undertow gpu-check``: the GPU serving path in one run, or its dry run on CPU.

``scripts/gpu_check.sh`` installs the ``vllm`` extra and calls it on a machine with an NVIDIA GPU;
``--dry-run`` runs every step with the CPU engine in place of ``vllm serve``
(:mod:`scheduler.gpu_check`).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add ``gpu-check`` to the root command."""

    @app.command("gpu-check")
    def gpu_check_cmd(
        dry_run: bool = typer.Option(False, "--dry-run", help="Serve with the CPU engine instead of vllm serve."),
        checkpoint: Path | None = typer.Option(
            None, "--checkpoint", help="v0 to serve (e.g. the demo's <home>/policy/v0000); default: a short warm-up."
        ),
        workdir: Path = typer.Option(Path(".undertow/gpu-check"), "--workdir", help="Scratch directory."),
        out: Path | None = typer.Option(None, "--out", help="Also write the JSON result to this file."),
        sft_steps: int = typer.Option(300, "--sft-steps", min=1, help="Warm-up steps when no --checkpoint."),
        sessions: int = typer.Option(4, "--sessions", min=1, help="Agent sessions per serving phase."),
        max_turns: int = typer.Option(4, "--max-turns", min=1, help="Policy turns per session."),
        dtype: str = typer.Option("auto", "--dtype", help="vllm serve --dtype."),
    ) -> None:
        """Serve v0, run agent sessions through the gateway, train and apply a delta, measure the
        train/serve logprob gap (replay on/off, batch invariance on/off); print one JSON object.

        Exit status: 0 when every step ran and the hash matched, 1 otherwise.
        """
        from scheduler.cli.common import print_json
        from scheduler.gpu_check import CheckConfig, run_check
        from scheduler.runtime.logs import configure_logging

        configure_logging("WARNING")  # stdout carries the JSON alone

        if checkpoint is not None and not checkpoint.is_dir():
            raise typer.BadParameter(f"{checkpoint} is not a directory", param_hint="--checkpoint")
        cfg = CheckConfig(
            backend="cpu" if dry_run else "vllm",
            workdir=workdir,
            checkpoint=checkpoint,
            sft_steps=sft_steps,
            sessions=sessions,
            max_turns=max_turns,
            dtype=dtype,
        )
        try:
            result = run_check(cfg)
        except (RuntimeError, ValueError, TimeoutError) as exc:
            result = {"ok": False, "error": str(exc), "backend": cfg.backend}
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print_json(result)
        raise typer.Exit(0 if result.get("ok") else 1)
