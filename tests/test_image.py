"""The services image and the gateway's bind address: what the build context leaves out, who the
image runs as, and a gateway that listens where its settings say."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _excluded(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a pattern matches from the context root (``**/`` at any depth), and a matched
    directory leaves out everything under it."""
    parts = path.split("/")
    for pattern in patterns:
        anywhere = pattern.startswith("**/")
        pat = pattern[3:] if anywhere else pattern
        for end in range(1, len(parts) + 1):
            prefixes = range(end) if anywhere else [0]
            if any(fnmatch.fnmatchcase("/".join(parts[start:end]), pat) for start in prefixes):
                return True
    return False


def _patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        ".undertow/undertow.db",
        ".undertow/keys/weights-signing.pem",
        ".env",
        ".env.production",
        "deploy/keys/signing.pem",
        "serving/__pycache__/gateway.cpython-311.pyc",
        "undertow.egg-info/PKG-INFO",
        "tests/.venv/bin/python",
    ],
)
def test_the_build_context_leaves_out_state_and_secrets(path: str) -> None:
    assert _excluded(path, _patterns()), path


@pytest.mark.parametrize("path", ["serving/gateway.py", "pyproject.toml", "migrations/env.py", "deploy/Dockerfile"])
def test_the_build_context_keeps_the_sources(path: str) -> None:
    assert (ROOT / path).exists() and not _excluded(path, _patterns())


def test_the_image_runs_as_an_unprivileged_user() -> None:
    lines = [line.split() for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()]
    users = [words[1] for words in lines if words and words[0] == "USER"]
    assert users and users[-1] not in ("root", "0"), users  # the last USER is the one that runs


def test_the_gateway_listens_on_the_configured_host(tmp_path: Path) -> None:
    from ingest.embedded import free_port

    host = "127.0.0.2"  # another loopback address: reachable here, and not the old hard-coded one
    port = free_port(host)
    env = {
        **os.environ,
        "UNDERTOW_HOME": str(tmp_path),
        "UNDERTOW_SERVING__GATEWAY__HOST": host,
        "UNDERTOW_SERVING__GATEWAY_PORT": str(port),
    }
    cmd = [sys.executable, "-m", "scheduler.cli", "gateway", "--replica", "http://127.0.0.1:9", "--no-telemetry"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{host}:{port}/health", timeout=1).status_code < 500:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                time.sleep(0.3)
        else:
            pytest.fail("the gateway never answered on its configured host")
        with pytest.raises(httpx.ConnectError):  # and not on the old default
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
