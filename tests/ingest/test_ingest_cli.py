"""The command line of this area, run as a user would: stats, ingest --once, dlq, broker, demo."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ingest_helpers import cli_env, last_json, raw, session_event, signal_event, undertow

from ingest.config import KafkaConfig

REPO = Path(__file__).resolve().parents[2]


def in_process(args: list[str], env: dict[str, str]) -> Any:
    """The same command through typer's runner (no interpreter start-up per call)."""
    from typer.testing import CliRunner

    from scheduler.cli import app

    result = CliRunner().invoke(app, args, env=env, catch_exceptions=False)
    result.returncode = result.exit_code
    return result


def test_ingest_once_stats_and_dlq_round_trip(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, producer: Any
) -> None:
    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    empty = in_process(["stats", "--json"], env)
    assert empty.returncode == 0, empty.stderr
    empty_stats = last_json(empty.stdout)
    assert empty_stats.pop("unreadable_batches")["held_partitions"] == []
    assert empty_stats == {"events": {}, "sessions": 0, "duplicates": 0, "dead_letters": 0}

    producer.send(session_event(1))
    producer.send(session_event(1))
    producer.send(signal_event("th-1", "feedback.thumbs", "sess-7-1", {"value": 1}))
    too_big_for_now = raw(session_event(2))
    producer.send_raw(too_big_for_now, key=b"sess-7-2")
    producer.send_raw(b"\x00not json", key=b"x")
    producer.flush()
    small_env = dict(env, UNDERTOW_KAFKA__MAX_MESSAGE_BYTES=str(len(too_big_for_now) - 1))
    first = in_process(["ingest", "--once"], small_env)
    assert first.returncode == 0, first.stderr
    assert last_json(first.stdout)["records"] == 5

    stats = last_json(in_process(["stats", "--json"], env).stdout)
    assert stats.pop("unreadable_batches")["count"] == 0
    assert stats == {
        "events": {"session.completed": 1, "feedback.thumbs": 1},
        "sessions": 1,
        "duplicates": 1,
        "dead_letters": 2,
    }
    listed = last_json(in_process(["dlq", "list", "--json"], env).stdout)["dead_letters"]
    assert sorted(d["reason"] for d in listed) == ["invalid_json", "oversized"]
    oversized = next(d for d in listed if d["reason"] == "oversized")

    refused = in_process(["dlq", "replay"], env)
    assert refused.returncode != 0 and "--id" in refused.output

    replayed = in_process(["dlq", "replay", "--id", str(oversized["id"])], env)
    assert replayed.returncode == 0, replayed.stderr
    assert last_json(replayed.stdout)["replayed"] == 1
    second = in_process(["ingest", "--once"], env)  # the default limit: the fix
    assert second.returncode == 0, second.stderr
    stats = last_json(in_process(["stats", "--json"], env).stdout)
    assert stats["sessions"] == 2 and stats["dead_letters"] == 2
    listed = last_json(in_process(["dlq", "list", "--json", "--pending"], env).stdout)["dead_letters"]
    assert [d["reason"] for d in listed] == ["invalid_json"]

    signals = last_json(in_process(["signals", "--session", "sess-7-1"], env).stdout)
    assert signals["sessions"][0]["signals"][0]["type"] == "feedback.thumbs"


def test_commands_without_a_broker_say_what_to_do(tmp_path: Path, kafka_cfg: KafkaConfig) -> None:
    env = cli_env(tmp_path, None, kafka_cfg)
    result = in_process(["ingest", "--once"], env)
    assert result.exit_code != 0
    assert "undertow broker" in str(result.exception) + result.output


def test_broker_command_writes_its_state_and_stops_cleanly(tmp_path: Path, kafka_cfg: KafkaConfig) -> None:
    env = cli_env(tmp_path, None, kafka_cfg)
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", "broker"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state = tmp_path / "home" / "broker.json"
    try:
        deadline = time.monotonic() + 60
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state.exists()
        time.sleep(1.0)  # topics created after the state file
        once = undertow(["ingest", "--once"], env)  # finds the broker through the state file
        assert once.returncode == 0, once.stderr
        assert last_json(once.stdout)["records"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not state.exists()


def test_demo_stage_one(tmp_path: Path, kafka_cfg: KafkaConfig) -> None:
    env = cli_env(tmp_path, None, kafka_cfg)
    args = ["demo", "--stage", "ingest", "--minutes", "0.1", "--requests", "60", "--seed", "3", "--json"]
    result = undertow(args, env, timeout=300)
    assert result.returncode == 0, result.stderr
    data = last_json(result.stdout)
    stats = data["stats"]
    assert stats["events"] == data["expected_events"]
    assert stats["duplicates"] == data["duplicates_sent"]
    assert stats["dead_letters"] == data["malformed_sent"] == 3
    assert data["waiting_for_session"] == {}
    assert not (tmp_path / "home" / "broker.json").exists()
