"""The checker's sandbox against hostile candidates (``tests/policy/hostile/``), its refusal without one, the CLI.

Each hostile body is written so that, were its attack to work, it would return the right
answer (or fool the comparison): a reward of 0 means the attack failed. Around them, legit
candidates in the same batch must still pass, and nothing (process or file) may be left behind.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import typer
from typer.testing import CliRunner

from policy import checker
from policy.checker import Limits, SandboxUnavailable, check, check_many
from policy.tasks import Task, train_tasks
from scheduler.cli.sandbox_cmds import register

HOSTILE = Path(__file__).with_name("hostile")
REPO = Path(__file__).resolve().parents[2]
TASK = train_tasks()[0]
ANSWER = TASK.concise.strip().removeprefix("return ")
WRONG = "    return -(10**9)\n"
SANDBOX_MARK = "Init process of the checker's sandbox"
TIMEOUTS = {"fork_bomb", "ignore_sigalrm", "sleep_forever"}


def _leftovers(markers: list[str]) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if any(m in cmdline for m in markers):
            found.append(f"{proc.info['pid']}: {cmdline[:80]}")
    return found


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port open on the host's loopback: reachable from anywhere but the sandbox."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    checker._probe.cache_clear()
    yield
    checker._probe.cache_clear()


def test_hostile_corpus_gets_no_reward_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listener: int
) -> None:
    tag = secrets.token_hex(6)
    secret = f"hostile-secret-{tag}"
    monkeypatch.setenv("UNDERTOW_HOSTILE_SECRET", secret)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("UNDERTOW_HOME", str(home))
    database = home / "undertow.db"
    database.write_bytes(b"original")
    outside = tmp_path / "outside" / "written.txt"
    planted = [REPO / f".hostile-{tag}", Path.home() / f".hostile-{tag}", Path(f"/var/tmp/hostile-{tag}")]
    planted += [Path(f"/dev/shm/hostile-{tag}"), REPO / f".hostile-ctypes-{tag}"]
    marker = f"{1_000_000 + secrets.randbelow(1_000_000)}.{secrets.randbelow(10**6):06d}"
    subs = {
        "@@TARGETS@@": json.dumps([str(p) for p in [outside, database, *planted[:4]]]),
        "@@TARGET@@": str(planted[4]),
        "@@ANSWER@@": ANSWER,
        "@@MARKER@@": marker,
        "@@SECRET@@": secret,
        "@@PORT@@": str(listener),
    }
    names = sorted(p.stem for p in HOSTILE.glob("*.body"))
    assert len(names) >= 14
    items: list[tuple[Task, str]] = []
    for name in names:
        body = (HOSTILE / f"{name}.body").read_text()
        for key, value in subs.items():
            body = body.replace(key, value)
        items += [(TASK, body), (TASK, TASK.concise), (TASK, WRONG)]

    start = time.monotonic()
    try:
        results = check_many(items, Limits(per_candidate_s=1.0, wall_s=120))
        elapsed = time.monotonic() - start
        left = _leftovers([marker, SANDBOX_MARK])
    finally:
        for path in planted:  # were the sandbox broken, do not leave its writes behind
            path.unlink(missing_ok=True)
    assert elapsed < 60
    by_name = {name: results[3 * k : 3 * k + 3] for k, name in enumerate(names)}
    for name, (hostile, legit, wrong) in by_name.items():
        assert not hostile.passed and not hostile.kept and hostile.tests_passed == 0, (name, hostile)
        assert legit.passed and legit.kept and legit.reason == "passed", (name, legit)
        assert not wrong.passed and wrong.reason == "failed 6 of 6 tests", (name, wrong)
        if name in TIMEOUTS:
            assert hostile.reason == "timeout", (name, hostile)
    assert by_name["always_equal"][0].reason == "output is not a plain JSON value"
    assert by_name["huge_return"][0].reason == "output is not a plain JSON value"
    assert left == []
    assert not outside.exists() and not outside.parent.exists()
    assert database.read_bytes() == b"original"
    assert not any(p.exists() for p in planted)


def test_values_compare_as_plain_json() -> None:
    task = Task("t0-json", 1, "pairs", "def f(x):", (((1,), (1, 2)), ((2,), [2, 3])), "", "", (), 40)
    bodies = {
        "    return [x, x + 1]\n": "passed",
        "    return (x, x + 1)\n": "passed",
        "    return [x, x + 1.0]\n": "passed",
        "    return [x, True] if x == 0 else [x, x + 1]\n": "passed",
        "    return [True, 2] if x == 1 else [x, x + 1]\n": "failed 1 of 2 tests",  # True is not 1
        "    class L(list):\n        pass\n    return L([x, x + 1])\n": "output is not a plain JSON value",
        "    class I(int):\n        pass\n    return [I(x), x + 1]\n": "output is not a plain JSON value",
        "    return {x: x + 1}\n": "output is not a plain JSON value",
        "    return [float('nan'), x]\n": "output is not a plain JSON value",
        "    return {x, x + 1}\n": "output is not a plain JSON value",
        "    raise ValueError\n": "failed 2 of 2 tests",
        "    import os\n    os._exit(0)\n": "crashed",
        "    return (\n": "syntax error",
        "x" * (checker.MAX_BODY_CHARS + 1): "body too long",
    }
    results = check_many([(task, body) for body in bodies])
    assert [r.reason for r in results] == list(bodies.values())
    assert [r.passed for r in results] == [reason == "passed" for reason in bodies.values()]
    assert all(r.tests == 2 for r in results)


def test_a_batch_of_64_is_quick() -> None:
    tasks = train_tasks()[::30][:64]
    check_many([(tasks[0], tasks[0].concise)])  # probe outside the timing
    start = time.monotonic()
    results = check_many([(t, t.concise) for t in tasks])
    assert all(r.kept for r in results)
    assert time.monotonic() - start < 20


def test_refuses_to_run_without_unshare(monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    monkeypatch.setattr(checker, "_unshare_path", lambda: None)
    with pytest.raises(SandboxUnavailable, match=r"unshare.*not found.*install util-linux"):
        check(TASK, TASK.concise)
    with pytest.raises(SandboxUnavailable):  # cached: no second probe, same refusal
        check_many([(TASK, TASK.concise)])


def test_refuses_to_run_without_user_namespaces(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_probe: None
) -> None:
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(checker, "_unshare_path", lambda: str(fake))
    with pytest.raises(SandboxUnavailable, match=r"Operation not permitted.*user namespaces"):
        check(TASK, TASK.concise)


@pytest.fixture
def app() -> typer.Typer:
    root = typer.Typer()
    register(root)
    return root


def test_cli_check(app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    good, evil = tmp_path / "good.py", tmp_path / "evil.py"
    good.write_text(TASK.concise)
    evil.write_text((HOSTILE / "always_equal.body").read_text())

    ok = runner.invoke(app, ["sandbox", "check", "--task", TASK.task_id, "--code", str(good), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout) == {
        "passed": True, "kept": True, "reason": "passed", "tests_passed": 6, "tests": 6,
        "size": len(TASK.concise.rstrip()),
    }  # fmt: skip
    bad = runner.invoke(app, ["sandbox", "check", "--task", TASK.task_id, "--code", str(evil), "--json"])
    assert bad.exit_code == 0, bad.output
    row = json.loads(bad.stdout)
    assert row["passed"] is False and row["kept"] is False and row["reason"] == "output is not a plain JSON value"

    unknown = runner.invoke(app, ["sandbox", "check", "--task", "t9-nope", "--code", str(good), "--json"])
    assert unknown.exit_code != 0 and "no task 't9-nope'" in unknown.output
    missing = runner.invoke(app, ["sandbox", "check", "--task", TASK.task_id, "--code", str(tmp_path / "no.py")])
    assert missing.exit_code != 0 and "cannot read" in missing.output

    checker._probe.cache_clear()
    monkeypatch.setattr(checker, "_unshare_path", lambda: None)
    try:
        refused = runner.invoke(app, ["sandbox", "check", "--task", TASK.task_id, "--code", str(good), "--json"])
    finally:
        checker._probe.cache_clear()
    assert refused.exit_code == 1
    row = json.loads(refused.stdout)
    assert row["passed"] is False and row["reason"].startswith("sandbox unavailable: ")
