"""The ``undertow`` command line. Thin: parse, then import the heavy code inside each command.

Each area registers its commands from its own module so the entry point stays small.
"""

from __future__ import annotations

import sys

import typer

from scheduler.cli import (
    api_cmds,
    config_cmds,
    db_cmds,
    demo_cmds,
    gateway_keys_cmds,
    gpu_cmds,
    import_cmds,
    ingest_cmds,
    jobs_cmds,
    policy_cmds,
    rewards_cmds,
    sandbox_cmds,
    serving_cmds,
    users_cmds,
    weights_cmds,
)

app = typer.Typer(
    name="undertow",
    help="Online reinforcement learning from production telemetry.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for module in (
    db_cmds,
    config_cmds,
    ingest_cmds,
    import_cmds,
    rewards_cmds,
    weights_cmds,
    serving_cmds,
    gateway_keys_cmds,
    jobs_cmds,
    policy_cmds,
    sandbox_cmds,
    api_cmds,
    demo_cmds,
    gpu_cmds,
    users_cmds,
):
    module.register(app)


def main() -> None:
    """Console-script entry point. A configuration that cannot be loaded is an error message and exit
    status 2, not a traceback."""
    try:
        app()
    except Exception as exc:
        loaded = sys.modules.get("scheduler.settings")  # raised there, so loaded; not imported for --help
        if loaded is None or not isinstance(exc, loaded.SettingsError):
            raise
        sys.stderr.write(f"undertow: the configuration cannot be loaded: {exc}\n")
        raise SystemExit(2) from None
