"""RealHumanEval's chat log as telemetry: the slice through the embedded broker, the ingest consumer and the
database to acceptance labels (both backends), re-imports that double nothing, malformed and hostile rows
reported by row and reason with nothing else lost, and ``undertow import realhumaneval`` as a user runs it.

Expectations come from the CSV itself (``csv`` and ``ast.literal_eval``), not from the importer.
"""

from __future__ import annotations

import ast
import csv
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import DATA, cli_env, duplicate_count, last_json, stored_count, undertow
from sqlalchemy import select

from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import ConsumerStats, IngestConsumer
from ingest.db import make_engine, transaction, upgrade
from ingest.realhumaneval import STUDY_START, FormatError, default_path, read_events
from ingest.signing import new_secret
from ingest.stats import stats
from ingest.tables import SessionRow
from reward_models.config import RewardsConfig
from reward_models.data import load_sessions, load_signals, session_records, signal_records
from reward_models.labels import build_labels

SLICE = DATA / "realhumaneval" / "chat_slice.csv"


def csv_rows(path: Path) -> list[dict[str, Any]]:
    """The file's rows with their literals parsed: the ground truth the importer is checked against."""
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        row["messages"] = ast.literal_eval(row["request"])
        row["copied"] = bool(ast.literal_eval(row["copy_events"]))
        row["occurred_at"] = STUDY_START + timedelta(seconds=float(row["timestamp"]))
    return rows


def send(producer: Any, events: list[dict[str, Any]]) -> None:
    futures = [producer.send(event) for event in events]
    producer.flush()
    for future in futures:
        future.get(timeout=30)


def consume(engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig) -> ConsumerStats:
    return IngestConsumer(engine, broker.bootstrap, kafka_cfg, ingest_cfg, mode="assign").run(once=True, max_seconds=60)


def labels_now(engine: Any) -> Any:
    return build_labels(load_sessions(engine), load_signals(engine), RewardsConfig(), datetime.now(UTC)).sessions


def test_the_slice_becomes_sessions_with_acceptance_labels_and_a_reimport_doubles_nothing(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    rows = csv_rows(SLICE)
    copied = sum(r["copied"] for r in rows)
    assert 0 < copied < len(rows)
    result = read_events(SLICE)

    send(producer, result.events)
    first = consume(engine, broker, kafka_cfg, ingest_cfg)

    assert (first.stored, first.dead_letters) == (2 * len(rows), 0)
    labels = labels_now(engine)
    assert int((labels["acceptance"] == 1.0).sum()) == copied
    assert int((labels["acceptance"] == 0.0).sum()) == len(rows) - copied
    sessions = load_sessions(engine).set_index(["user_id", "occurred_at"])
    assert len(sessions) == len(rows)
    for row in rows:  # each stored session is its row: who, when, which model, what was asked and answered
        stored = sessions.loc[(f"rhe-{row['programmer_id']}", row["occurred_at"])]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert (stored["model"], stored["policy_version"]) == (row["model"], row["model"])
        assert stored["completion_text"] == row["response"]
        assert stored["prompt_text"] == (users[-1] if users else "")
        assert labels.loc[stored["session_id"], "acceptance"] == float(row["copied"])

    links = 0  # a row whose request is an earlier row's request, its answer and one new message continues that chat
    by_user: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: float(r["timestamp"])):
        for earlier in by_user.get(row["programmer_id"], []):
            if earlier["messages"] + [{"content": earlier["response"], "role": "assistant"}] == row["messages"][:-1]:
                this = sessions.loc[(f"rhe-{row['programmer_id']}", row["occurred_at"]), "agent_session"]
                before = sessions.loc[(f"rhe-{earlier['programmer_id']}", earlier["occurred_at"]), "agent_session"]
                assert this == before and this is not None
                links += 1
        by_user.setdefault(row["programmer_id"], []).append(row)
    assert links >= 20
    assert sessions["agent_session"].nunique() < len(rows)
    with transaction(engine) as s:
        extras = list(s.scalars(select(SessionRow.extra)))
    means = sorted(e["served_logprobs"]["mean"] for e in extras)
    assert means == sorted(ast.literal_eval(r["logprobs"])["mean"] for r in rows)
    assert {e["source"] for e in extras} == {"realhumaneval"}

    send(producer, read_events(SLICE).events)
    again = consume(engine, broker, kafka_cfg, ingest_cfg)

    assert (again.stored, again.duplicates, again.dead_letters) == (0, 2 * len(rows), 0)
    assert stored_count(engine) == 2 * len(rows)
    assert duplicate_count(engine) == 2 * len(rows)
    assert labels_now(engine)["acceptance"].sum() == copied


def test_the_events_are_what_reward_models_read_without_a_database() -> None:
    """What ``benchmarks/rewards.py`` does: the events straight into ``session_records`` and ``signal_records``."""
    rows = csv_rows(SLICE)
    result = read_events(SLICE)
    sessions = session_records([e for e in result.events if e["type"] == "session.completed"])
    signals = signal_records(result.events)

    assert list(sessions["completion_text"]) == [r["response"] for r in rows]
    assert list(sessions["user_id"]) == [f"rhe-{r['programmer_id']}" for r in rows]
    accepted = set(signals.loc[signals["type"] == "edit.accepted", "session_id"])
    assert [sid in accepted for sid in sessions["session_id"]] == [r["copied"] for r in rows]
    assert len(signals) == len(rows)


def test_event_ids_follow_the_rows_not_the_file_order_or_the_limit(tmp_path: Path) -> None:
    with SLICE.open(newline="", encoding="utf-8") as handle:
        header, *records = list(csv.reader(handle))
    reversed_file = tmp_path / "reversed.csv"
    with reversed_file.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle, lineterminator="\n").writerows([header, *reversed(records)])

    whole = read_events(SLICE).events
    assert read_events(SLICE).events == whole
    assert read_events(SLICE, limit=10).events == whole[:20]
    assert read_events(reversed_file).rows == len(records)
    assert sorted(json.dumps(e, sort_keys=True) for e in read_events(reversed_file).events) == sorted(
        json.dumps(e, sort_keys=True) for e in whole
    )
    later = read_events(SLICE, study_start=STUDY_START + timedelta(days=30)).events
    assert [e["event_id"] for e in later] == [e["event_id"] for e in whole]
    assert later[0]["occurred_at"] != whole[0]["occurred_at"]


def hostile_file(tmp_path: Path) -> tuple[Path, list[tuple[list[str], str | None]], list[str]]:
    """The slice with hostile rows between its rows: ``(path, [(cells, expected reason or None if kept)], header)``."""
    with SLICE.open(newline="", encoding="utf-8") as handle:
        header, *good = list(csv.reader(handle))
    col = {name: i for i, name in enumerate(header)}

    def like(base: list[str], **cells: str) -> list[str]:
        out = list(base)
        for name, value in cells.items():
            out[col[name]] = value
        return out

    hostile: list[tuple[list[str], str | None]] = [
        (like(good[0], request="[{'content': 'unclosed', 'role': 'user'}"), "request is not a Python literal"),
        (good[1][:-1], "7 cells where the header has 8"),
        (like(good[2], programmer_id="6\x004"), "programmer_id '6\\x004' is not"),
        (like(good[3], copy_events="[{'type': 'copy_chat', 'copied': 'a\x00b'}]"), "copy_events is not a Python"),
        (like(good[4], model="GPT\x1b[31m"), "model 'GPT\\x1b[31m' contains control characters"),
        (like(good[5], response="x" * ((1 << 20) + 1)), "oversized: response is 1,048,577 bytes"),
        (like(good[6], timestamp="soon"), "timestamp 'soon' is not a number"),
        (like(good[7], request="__import__('os').system('touch pwned')"), "request is not a Python literal"),
        (like(good[8], request="[{'content': 'hi', 'role': 'wizard'}]"), "request message 0 is not"),
        (like(good[9], logprobs="[1, 2]"), "logprobs is a list literal, not a dict"),
        (like(good[10], task_name=" "), "task_name is empty"),
        (like(good[11], response="caf\udcc3 broken bytes"), "response is not valid UTF-8"),
        (list(good[12]), "same programmer_id, task_name and timestamp as row"),
        (like(good[13], programmer_id="hostile-1", response="nul \x00 kept; 'quotes' \u202e rtl"), None),
    ]
    rows: list[tuple[list[str], str | None]] = []
    for i, record in enumerate(good):
        rows.append((record, None))
        if i < len(hostile):
            rows.append(hostile[i])
    path = tmp_path / "hostile.csv"
    with path.open("w", newline="", encoding="utf-8", errors="surrogateescape") as handle:
        csv.writer(handle, lineterminator="\n").writerows([header] + [cells for cells, _ in rows])
    return path, rows, header


def first_line(cells: list[str]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(cells)
    return out.getvalue().split("\n", 1)[0]


def test_malformed_and_hostile_rows_are_reported_by_row_and_reason_and_nothing_else_is_lost(tmp_path: Path) -> None:
    path, rows, header = hostile_file(tmp_path)

    result = read_events(path)

    assert not Path("pwned").exists()  # a literal is never run
    assert result.rows == len(rows)
    expected = {n: reason for n, (_, reason) in enumerate(rows, start=1) if reason is not None}
    assert {s.row: s.reason for s in result.skipped}.keys() == expected.keys()
    lines = path.read_text(encoding="utf-8", errors="surrogateescape").split("\n")
    for skip in result.skipped:
        assert expected[skip.row] in skip.reason, (skip, expected[skip.row])
        assert lines[skip.line - 1] == first_line(rows[skip.row - 1][0])  # the line the record starts on
    duplicate = next(s for s in result.skipped if "same programmer_id" in s.reason)
    assert f"as row {[c for c, _ in rows].index(rows[duplicate.row - 1][0]) + 1}:" in duplicate.reason

    kept = [e for e in result.events if e["user_id"] == "rhe-hostile-1"]
    source = next(c for c, _ in rows if c[header.index("programmer_id")] == "hostile-1")
    copied = bool(ast.literal_eval(source[header.index("copy_events")]))
    assert [e["type"] for e in kept] == ["session.completed", "edit.accepted" if copied else "edit.rejected"]
    assert kept[0]["payload"]["segments"][0]["text"] == "nul \x00 kept; 'quotes' \u202e rtl"
    others = [e for e in result.events if e["user_id"] != "rhe-hostile-1"]
    assert others == read_events(SLICE).events


def test_text_the_contract_allows_is_stored_whole(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any, tmp_path: Path
) -> None:
    """NUL, quotes and a right-to-left override in an answer reach the database (PostgreSQL holds NUL as U+FFFD)."""
    path, rows, _ = hostile_file(tmp_path)
    result = read_events(path)
    send(producer, result.events)

    report = consume(engine, broker, kafka_cfg, ingest_cfg)

    assert (report.stored, report.dead_letters) == (len(result.events), 0)
    sessions = load_sessions(engine).set_index("user_id")
    stored = str(sessions.loc["rhe-hostile-1", "completion_text"])
    assert stored.replace("\ufffd", "\x00") == "nul \x00 kept; 'quotes' \u202e rtl"
    assert len(sessions) == sum(1 for _, reason in rows if reason is None)


def test_a_file_without_the_columns_is_refused_with_the_missing_ones(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text('request,response,model\n"[]",hi,m\n', encoding="utf-8")
    with pytest.raises(FormatError, match="lacks copy_events, logprobs, programmer_id, timestamp, task_name"):
        read_events(path)


def test_the_whole_file_beside_the_project_parses_completely() -> None:
    path = default_path()
    if path is None:
        pytest.skip("../shared/data/real/realhumaneval/chat_data.csv is not beside the project")
    csv.field_size_limit(1 << 26)
    rows = csv_rows(path)

    result = read_events(path)

    assert result.skipped == []
    assert result.rows == result.sessions == result.signals == len(rows)
    summary = result.summary()
    assert summary["accepted"] == sum(r["copied"] for r in rows)
    assert summary["users"] == len({r["programmer_id"] for r in rows})


def test_cli_dry_run_reads_and_reports_without_a_broker(tmp_path: Path, kafka_cfg: KafkaConfig) -> None:
    rows = csv_rows(SLICE)
    env = cli_env(tmp_path, None, kafka_cfg)  # no broker anywhere: a dry run must not need one

    done = undertow(["import", "realhumaneval", str(SLICE), "--dry-run", "--json"], env)

    assert done.returncode == 0, done.stderr
    summary = last_json(done.stdout)
    assert (summary["rows"], summary["sessions"], summary["signals"]) == (len(rows),) * 3
    assert (summary["accepted"], summary["skipped"], summary["sent"]) == (sum(r["copied"] for r in rows), 0, 0)
    assert summary["dry_run"] is True and summary["warnings"] == []

    path, hostile, _ = hostile_file(tmp_path)
    limited = undertow(["import", "realhumaneval", str(path), "--dry-run", "--json", "--limit", "6"], env)
    assert limited.returncode == 0, limited.stderr
    listed = last_json(limited.stdout)
    assert listed["rows"] == 6
    expected = [(n, reason) for n, (_, reason) in enumerate(hostile[:6], start=1) if reason is not None]
    assert [s["row"] for s in listed["skipped_rows"]] == [n for n, _ in expected]
    assert all(reason in s["reason"] for s, (_, reason) in zip(listed["skipped_rows"], expected, strict=True))


def test_cli_sends_signed_events_that_ingest_stores_once(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig
) -> None:
    """With signing on, the import is signed with the replay key and stored; importing twice stores nothing
    twice; a key that is not configured is refused before anything is sent."""
    rows = csv_rows(SLICE)
    keys = {"dlq-replay": new_secret(), "gateway": new_secret()}
    env = dict(cli_env(tmp_path, broker.bootstrap, kafka_cfg), UNDERTOW_INGEST__SIGNING_KEYS=json.dumps(keys))
    args = ["import", "realhumaneval", str(SLICE), "--json", "--study-start", "2026-01-05T09:00:00+01:00"]

    refused = undertow([*args, "--key-id", "stranger"], env)
    assert refused.returncode == 2 and "'stranger' is not one of ingest.signing_keys" in refused.stderr
    runs = [undertow(args, env) for _ in range(2)]

    for run in runs:
        assert run.returncode == 0, run.stderr
        summary = last_json(run.stdout)
        assert (summary["sent"], summary["signed_with"]) == (2 * len(rows), "dlq-replay")
    upgrade(f"sqlite:///{tmp_path / 'ingest.db'}")
    engine = make_engine(f"sqlite:///{tmp_path / 'ingest.db'}")
    report = consume(engine, broker, kafka_cfg, ingest_cfg.model_copy(update={"signing_keys": keys}))
    assert (report.records, report.stored, report.duplicates, report.dead_letters) == (
        4 * len(rows),
        2 * len(rows),
        2 * len(rows),
        0,
    )
    counts = stats(engine)
    assert counts["sessions"] == len(rows) and counts["events"]["edit.accepted"] == sum(r["copied"] for r in rows)
    first = min(load_sessions(engine)["occurred_at"])
    assert first == datetime(2026, 1, 5, 8, 0, tzinfo=UTC) + timedelta(seconds=min(float(r["timestamp"]) for r in rows))
