"""``undertow weights`` against a real store under a temporary Undertow home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from scheduler.cli import app


def _run(args: list[str], home: Path, code: int = 0) -> dict:
    result = CliRunner().invoke(app, ["weights", *args], env={"UNDERTOW_HOME": str(home)})
    assert result.exit_code == code, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]) if "--json" in args else {}


def test_weights_cli(tmp_path: Path, checkpoints: list[Path]) -> None:
    home = tmp_path / "home"
    versions = [_run(["put", str(path), "--json"], home)["version"] for path in checkpoints]
    listed = _run(["list", "--json"], home)["versions"]
    assert [row["version"] for row in listed] == versions
    diff = _run(["diff", versions[0], versions[1], "--json"], home)
    assert 0 < diff["changed"] < diff["numel"] and diff["delta_bytes"] < diff["raw_bytes"]
    assert _run(["verify", versions[1], "--json"], home) == {"version": versions[1], "ok": True, "checked": ["delta"]}
    delta = home / "weights" / "versions" / versions[1] / "delta.bin"
    raw = bytearray(delta.read_bytes())
    raw[len(raw) // 2] ^= 1
    delta.write_bytes(bytes(raw))
    assert _run(["verify", versions[1], "--json"], home, code=1)["ok"] is False
    gc = _run(["gc", "--keep", versions[0], "--retain", "1", "--dry-run", "--json"], home)
    assert versions[0] in gc["keep"] and versions[2] in gc["keep"]


@pytest.mark.parametrize("version", ["../escape", "", "a/b"])
def test_hostile_version_ids_are_refused(tmp_path: Path, version: str) -> None:
    result = CliRunner().invoke(app, ["weights", "verify", version, "--json"], env={"UNDERTOW_HOME": str(tmp_path)})
    assert result.exit_code != 0
