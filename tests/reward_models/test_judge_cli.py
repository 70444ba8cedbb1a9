"""The LLM-judge signal against a real HTTP server on 127.0.0.1, and the ``undertow rewards`` commands."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sqlalchemy.engine import Engine

from reward_models.config import JudgeConfig
from reward_models.judge import judge_sessions, parse_score

START = datetime(2026, 1, 5, tzinfo=UTC)


class _Judge(BaseHTTPRequestHandler):
    """Speaks the chat completions subset: 2 for answers that return None, else 9; hostile replies on cue."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        text = body["messages"][-1]["content"]
        if self.path != "/v1/chat/completions":
            self.send_error(404)
            return
        if "BOOM" in text:
            self.send_error(500)
            return
        if "GARBAGE" in text:
            payload = b"{not json"
        elif "NOSCORE" in text:
            payload = json.dumps({"choices": [{"message": {"content": "I cannot grade this."}}]}).encode()
        else:
            score = "2" if "return None" in text else "9"
            payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": score}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def judge_url() -> Iterator[str]:
    _Judge.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_parse_score() -> None:
    assert parse_score("7") == 0.7 and parse_score("Score: 10") == 1.0 and parse_score("0") == 0.0
    assert (
        parse_score("eleven") is None
        and parse_score("11") is None
        and parse_score("") is None
        and parse_score("7.5") is None
    )


def test_judge_scores_one_dimension_per_call_and_caches(sqlite_engine: Engine, judge_url: str) -> None:
    import pandas as pd

    sessions = pd.DataFrame(
        {
            "session_id": ["a", "b", "c", "d", "e", "f"],
            "prompt_text": ["add", "add", "x", "x", "x", "x"],
            "completion_text": ["return a + b", "return None", "BOOM", "GARBAGE", "NOSCORE", ""],
        }
    )
    config = JudgeConfig(
        enabled=True, base_url=judge_url, dimensions={"correctness": "Is it correct?", "style": "Is it concise?"}
    )
    scores, stats = judge_sessions(sqlite_engine, sessions, config)
    assert stats == {"judge_calls": 10, "judge_cached": 0, "judge_failed": 6, "judge_skipped_no_text": 1}
    assert scores.loc["a", "judge:correctness"] == pytest.approx(0.9) and scores.loc[
        "b", "judge:style"
    ] == pytest.approx(0.2)
    assert scores.loc[["c", "d", "e"]].isna().all().all()
    rubrics = {c["messages"][-1]["content"].split("\n")[0] for c in _Judge.calls}
    assert rubrics == {"Rubric: Is it correct?", "Rubric: Is it concise?"}  # one dimension per call
    _Judge.calls = []
    again, stats2 = judge_sessions(sqlite_engine, sessions, config)
    assert stats2["judge_cached"] == 4 and stats2["judge_calls"] == 6  # only the failures are asked again
    assert again.loc["a", "judge:correctness"] == pytest.approx(0.9)
    assert all(
        "BOOM" in c["messages"][-1]["content"]
        or "GARBAGE" in c["messages"][-1]["content"]
        or "NOSCORE" in c["messages"][-1]["content"]
        for c in _Judge.calls
    )


def test_judge_endpoint_down_is_counted_not_fatal(sqlite_engine: Engine) -> None:
    import pandas as pd

    from ingest.embedded import free_port

    config = JudgeConfig(
        enabled=True, base_url=f"http://127.0.0.1:{free_port()}/v1", timeout_s=2, dimensions={"c": "ok?"}
    )
    scores, stats = judge_sessions(
        sqlite_engine, pd.DataFrame({"session_id": ["a"], "prompt_text": ["p"], "completion_text": ["c"]}), config
    )
    assert (stats["judge_failed"] == 1 and scores.empty) or scores.isna().all().all()


def _invoke(args: list[str], env: dict[str, str]) -> Any:
    """Run the CLI in-process; afterwards restore logging, which the CLI bound to the runner's captured stderr."""
    import logging

    import structlog
    from typer.testing import CliRunner

    from scheduler.cli import app

    try:
        return CliRunner().invoke(app, args, env=env)
    finally:
        structlog.reset_defaults()
        logging.basicConfig(force=True)


@pytest.mark.slow
def test_cli_train_score_list(tmp_path: Path, load_events: Any, judge_url: str) -> None:
    from ingest.db import make_engine, upgrade
    from reward_models.synthetic import generate_events

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    upgrade(url)
    engine = make_engine(url)
    now = datetime.now(UTC)
    events, _ = generate_events(300, seed=11, start=now - timedelta(days=6), span_s=4 * 86400, now=now)
    load_events(engine, events)
    env = {
        "UNDERTOW_HOME": str(tmp_path / "home"),
        "UNDERTOW_DATABASE_URL": url,
        "UNDERTOW_REWARDS__JUDGE__ENABLED": "true",
        "UNDERTOW_REWARDS__JUDGE__BASE_URL": judge_url,
        "UNDERTOW_REWARDS__JUDGE__MAX_SESSIONS": "20",
    }
    result = _invoke(["rewards", "train", "--json"], env)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["versions"] == [report["version"]] and report["metrics"]["retention"]["auc"] is not None
    assert report["extra"]["judge"]["judge_calls"] == 60 and report["coverage"]["judge:correctness"]["weight"] == 0.0
    assert (tmp_path / "home" / "reward_models").is_dir()

    sessions = [e for e in events if e["type"] == "session.completed"][:5]
    lines = [json.dumps(e) for e in reversed(sessions)]
    infile = tmp_path / "in.jsonl"
    infile.write_text("\n".join(lines) + "\n\n")
    scored = _invoke(["rewards", "score", "--version", "latest", "--input", str(infile)], env)
    assert scored.exit_code == 0, scored.output
    out = [json.loads(line) for line in scored.stdout.strip().splitlines()]
    assert [o["session_id"] for o in out] == [e["session_id"] for e in reversed(sessions)]
    assert all(isinstance(o["reward"], float) for o in out)
    by_id = _invoke(["rewards", "score", "--version", report["version"], "--input", str(infile)], env)
    assert by_id.stdout == scored.stdout

    for bad, reason in (
        ('{"type": "session.completed"', "invalid_json"),
        (json.dumps({**sessions[0], "type": "feedback.thumbs"}), "validation_error"),
        (json.dumps(events[-1]), "cannot be scored"),
        ("x" * (2 << 20), "oversized"),
    ):
        infile.write_text(lines[0] + "\n" + bad + "\n")
        failed = _invoke(["rewards", "score", "--input", str(infile)], env)
        assert failed.exit_code == 2 and "line 2" in failed.stderr and reason in failed.stderr, failed.stderr
        assert failed.stdout == ""
    missing = _invoke(["rewards", "score", "--version", "rm-0000-none", "--input", str(infile)], env)
    assert missing.exit_code == 2 and "rewards list" in missing.stderr

    listed = _invoke(["rewards", "list", "--json"], env)
    assert json.loads(listed.stdout)["versions"][0]["version"] == report["version"]


def test_cli_train_without_data_is_a_clear_error(tmp_path: Path) -> None:
    env = {"UNDERTOW_HOME": str(tmp_path / "home")}
    result = _invoke(["rewards", "train", "--json"], env)
    assert result.exit_code == 2
    assert json.loads(result.stdout.strip().splitlines()[-1])["versions"] == []
    assert "undertow ingest" in result.stderr
