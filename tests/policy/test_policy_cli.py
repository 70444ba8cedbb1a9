"""``undertow policy``: warm-up, one RL version, versions list and eval, end to end on SQLite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from scheduler.cli.policy_cmds import register


@pytest.fixture
def app() -> typer.Typer:
    root = typer.Typer()
    register(root)
    return root


def _last_json(output: str) -> dict:  # type: ignore[type-arg]
    return json.loads(output.strip().splitlines()[-1])


def test_policy_commands_end_to_end(app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERTOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("UNDERTOW_POLICY__RL_STEPS_PER_VERSION", "1")
    runner = CliRunner()

    empty = runner.invoke(app, ["policy", "versions", "--json"])
    assert empty.exit_code == 0, empty.output
    assert _last_json(empty.stdout) == {"versions": []}
    missing = runner.invoke(app, ["policy", "train", "--json"])
    assert missing.exit_code != 0 and "warmup" in str(missing.exception)

    warm = runner.invoke(app, ["policy", "warmup", "--steps", "2", "--samples", "1", "--per-tier", "1", "--json"])
    assert warm.exit_code == 0, warm.output
    v0 = _last_json(warm.stdout)
    assert v0["version"] == "v0000" and v0["parent"] is None and "eval/keep_rate" in v0["metrics"]
    assert (Path(v0["checkpoint"]) / "model.safetensors").exists()

    train = runner.invoke(app, ["policy", "train", "--samples", "1", "--per-tier", "1", "--json"])
    assert train.exit_code == 0, train.output
    (v1,) = _last_json(train.stdout)["versions"]
    assert v1["version"] == "v0001" and v1["parent"] == "v0000" and v1["step"] == 1

    listed = _last_json(runner.invoke(app, ["policy", "versions", "--json"]).stdout)
    assert [v["version"] for v in listed["versions"]] == ["v0000", "v0001"]
    ev = runner.invoke(app, ["policy", "eval", "--version", "v0001", "--samples", "1", "--per-tier", "1", "--json"])
    assert ev.exit_code == 0 and _last_json(ev.stdout)["version"] == "v0001"
    bad = runner.invoke(app, ["policy", "eval", "--version", "v9999", "--json"])
    assert bad.exit_code != 0 and "v9999" in bad.output
    assert runner.invoke(app, ["policy", "train", "--versions", "0"]).exit_code != 0


@pytest.mark.slow
def test_policy_train_with_two_processes(app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--nproc 2`` runs torchrun (2 gloo ranks, FSDP): rank 0 alone writes the version and stdout."""
    home = tmp_path / "home"
    monkeypatch.setenv("UNDERTOW_HOME", str(home))
    monkeypatch.setenv("UNDERTOW_POLICY__RL_STEPS_PER_VERSION", "2")
    runner = CliRunner()
    warm = runner.invoke(app, ["policy", "warmup", "--steps", "2", "--samples", "1", "--per-tier", "1", "--json"])
    assert warm.exit_code == 0, warm.output

    args = ["policy", "train", "--nproc", "2", "--versions", "2", "--samples", "1", "--per-tier", "1", "--json"]
    train = runner.invoke(app, args)
    assert train.exit_code == 0, train.output
    assert len(train.stdout.strip().splitlines()) == 1  # one JSON object, from rank 0 only
    v1, v2 = _last_json(train.stdout)["versions"]
    assert (v1["version"], v1["parent"], v1["step"]) == ("v0001", "v0000", 2)
    assert (v2["version"], v2["parent"], v2["step"]) == ("v0002", "v0001", 4)
    assert v2["metrics"]["train/steps"] == 2.0 and "eval/keep_rate" in v2["metrics"]
    for v in (v1, v2):
        assert (Path(v["checkpoint"]) / "model.safetensors").exists()
    assert not (home / "policy" / "state" / "v0002").exists()  # the resumable state is cleared after the row
    listed = _last_json(runner.invoke(app, ["policy", "versions", "--json"]).stdout)
    assert [v["version"] for v in listed["versions"]] == ["v0000", "v0001", "v0002"]
    # rank 0 saved whole (gathered) weights: the checkpoint loads and evaluates in one process
    ev = runner.invoke(app, ["policy", "eval", "--version", "v0002", "--samples", "1", "--per-tier", "1", "--json"])
    assert ev.exit_code == 0 and _last_json(ev.stdout)["eval/keep_rate"] == v2["metrics"]["eval/keep_rate"]
