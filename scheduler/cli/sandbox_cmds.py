"""``undertow sandbox``: run one candidate body through the checker's sandbox, as the reward does.

``undertow sandbox check --task ID --code FILE`` reads a function body from FILE (indented as
under ``def f(...):``), checks it against the task's hidden tests with :func:`policy.checker.check`
(exactly the reward's code path) and prints the verdict. Useful to look at a suspicious candidate
from a rollout, or to see why the sandbox refuses to run on a machine.
"""

from __future__ import annotations

from pathlib import Path

import typer

sandbox_app = typer.Typer(
    help="The checker's sandbox: check a candidate body as the RL reward does.", no_args_is_help=True
)


@sandbox_app.command("check")
def check_cmd(
    task_id: str = typer.Option(..., "--task", help="Task id (as in the task family, e.g. t1-0123456789ab)."),
    code: Path = typer.Option(..., "--code", help="File holding the function body, indented under the signature."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check a candidate body against a task's hidden tests, inside the sandbox.

    Exit status: 0 when the check ran (whatever the verdict), 1 without a sandbox, 2 on bad arguments.
    """
    from policy.checker import SandboxUnavailable, check
    from policy.tasks import task_by_id
    from scheduler.cli.common import print_json

    try:
        task = task_by_id(task_id)
    except KeyError as exc:
        raise typer.BadParameter(f"{exc.args[0]}; ids look like t1-0123456789ab", param_hint="--task") from exc
    try:
        body = code.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {code}: {exc}", param_hint="--code") from exc
    tests = len(task.tests)
    try:
        result = check(task, body)
        row = {
            "passed": result.passed,
            "kept": result.kept,
            "reason": result.reason,
            "tests_passed": result.tests_passed,
            "tests": tests,
            "size": result.size,
        }
        code_out = 0
    except SandboxUnavailable as exc:
        from policy.checker import body_size

        row = {"passed": False, "kept": False, "reason": str(exc), "tests_passed": 0, "tests": tests}
        row["size"] = body_size(body)
        code_out = 1
    if as_json:
        print_json(row)
    else:
        typer.echo(
            f"{task.task_id}: {row['reason']} ({row['tests_passed']}/{tests} tests, "
            f"{row['size']} chars, {'kept' if row['kept'] else 'not kept'})"
        )
    if code_out:
        raise typer.Exit(code_out)


def register(app: typer.Typer) -> None:
    """Attach the ``sandbox`` group."""
    app.add_typer(sandbox_app, name="sandbox")
