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
    key_id = _run(["keygen", "--json"], home)["key_id"]  # the first put made the key; keygen keeps it
    verified = {"version": versions[1], "ok": True, "signed_by": key_id, "checked": ["delta"]}
    assert _run(["verify", versions[1], "--json"], home) == verified
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


def test_weights_serve_shares_the_store_over_http(tmp_path: Path, checkpoints: list[Path]) -> None:
    import os
    import subprocess
    import sys
    import time

    import httpx

    from ingest.embedded import free_port
    from policy.weights import WeightStore

    home = tmp_path / "home"
    versions = [_run(["put", str(path), "--json"], home)["version"] for path in checkpoints[:2]]
    port = free_port()
    env = {**os.environ, "UNDERTOW_HOME": str(home)}
    cmd = [sys.executable, "-m", "scheduler.cli", "weights", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/-/health").json()["versions"] == 2:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the store server did not start"
                time.sleep(0.2)
        remote, local = WeightStore(f"http://127.0.0.1:{port}/"), WeightStore(home / "weights")
        assert remote.version_ids() == versions
        assert remote.manifest(versions[1]).version_hash == local.manifest(versions[1]).version_hash
    finally:
        proc.terminate()
        proc.wait(10)


def test_weights_serve_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["weights", "serve", "--root", str(tmp_path / "nothing")], env={"UNDERTOW_HOME": str(tmp_path)}
    )
    assert result.exit_code == 2 and "not a weight store" in result.output


def test_keygen_rotation_and_signing_again(tmp_path: Path, checkpoints: list[Path]) -> None:
    import stat

    home = tmp_path / "home"
    first = _run(["keygen", "--json"], home)
    assert first["created"] is True and first["trusted"] == [first["key_id"]]
    assert stat.S_IMODE(Path(first["signing_key"]).stat().st_mode) == 0o600
    assert _run(["keygen", "--json"], home)["key_id"] == first["key_id"]  # kept, not replaced
    old = [_run(["put", str(path), "--json"], home)["version"] for path in checkpoints[:2]]

    rotated = _run(["keygen", "--rotate", "--json"], home)
    assert rotated["key_id"] != first["key_id"] and rotated["trusted"] == sorted([first["key_id"], rotated["key_id"]])
    new = _run(["put", str(checkpoints[2]), "--json"], home)["version"]
    signers = {row["version"]: row["signed_by"] for row in _run(["list", "--json"], home)["versions"]}
    assert signers == {old[0]: first["key_id"], old[1]: first["key_id"], new: rotated["key_id"]}
    assert all(_run(["verify", v, "--json"], home)["ok"] for v in [*old, new])  # both keys trusted meanwhile

    assert _run(["sign", "--all", "--json"], home) == {
        "key_id": rotated["key_id"],
        "signed": [*old, new],
        "refused": {},
    }
    public = Path(rotated["public_key_file"])
    public.write_text(rotated["public_key"])  # the old key leaves the file replicas read
    for version in [*old, new]:
        assert _run(["verify", version, "--json"], home)["signed_by"] == rotated["key_id"]

    # A manifest changed after it was signed is refused by verify, and never signed again without --force.
    manifest = home / "weights" / "versions" / old[1] / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["meta"]["source"] = "elsewhere"
    manifest.write_text(json.dumps(doc))
    assert "does not match its signature" in _run(["verify", old[1], "--json"], home, code=1)["error"]
    refused = _run(["sign", old[1], "--json"], home, code=1)["refused"]
    assert "does not match its signature" in refused[old[1]]
