"""Any table of answers and adoption labels as telemetry (``undertow import table``): real rows (the
RealHumanEval slice, flattened into a plain table as an export would be) through the CLI, the embedded broker
and the ingest consumer to acceptance labels and linked chats; JSON Lines with nested keys and every time
format; malformed and hostile rows reported by row and reason with nothing else lost; ids that follow the
rows; and mappings and files that are refused before anything is read.

Expectations come from the rows the test writes, not from the importer.
"""

from __future__ import annotations

import ast
import csv
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import DATA, cli_env, last_json, stored_count, undertow
from sqlalchemy import select

from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import IngestConsumer
from ingest.db import make_engine, transaction, upgrade
from ingest.imports import FormatError
from ingest.table_import import ColumnMap, read_events
from ingest.tables import SessionRow
from reward_models.config import RewardsConfig
from reward_models.data import load_sessions, load_signals, session_records, signal_records
from reward_models.labels import build_labels

SLICE = DATA / "realhumaneval" / "chat_slice.csv"
START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
MAPPING = "user=who,prompt=question,response=answer,label=copied,time=seconds,model=assistant,task=task,logprob=lp"


def flat_rows() -> list[dict[str, Any]]:
    """The slice as a plain export: one row per answer, the last user message as the prompt, yes/no labels."""
    with SLICE.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    out = []
    for row in rows:
        messages = ast.literal_eval(row["request"])
        users = [m["content"] for m in messages if m["role"] == "user"]
        out.append(
            {
                "who": f"p{row['programmer_id']}",
                "question": users[-1] if users else "",
                "answer": row["response"],
                "copied": "yes" if ast.literal_eval(row["copy_events"]) else "no",
                "seconds": row["timestamp"],
                "assistant": row["model"],
                "task": row["task_name"],
                "lp": repr(ast.literal_eval(row["logprobs"])["mean"]),
            }
        )
    return out


def write_csv(path: Path, rows: list[dict[str, Any]], delimiter: str = ",") -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_a_real_export_goes_through_kafka_into_labels_and_chats_and_a_reimport_doubles_nothing(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig
) -> None:
    rows = flat_rows()
    copied = sum(r["copied"] == "yes" for r in rows)
    assert 0 < copied < len(rows)
    path = write_csv(tmp_path / "export.csv", rows)
    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    args = ["import", "table", str(path), "--map", MAPPING, "--map", "conversation=task"]
    args += ["--time-format", "offset", "--start", START.isoformat(), "--source", "rhe-export", "--json"]

    runs = [undertow(args, env) for _ in range(2)]

    for run in runs:
        assert run.returncode == 0, run.stderr
        summary = last_json(run.stdout)
        assert (summary["rows"], summary["sessions"], summary["signals"], summary["skipped"]) == (
            len(rows),
            len(rows),
            len(rows),
            0,
        )
        assert (summary["accepted"], summary["sent"]) == (copied, 2 * len(rows))
    url = f"sqlite:///{tmp_path / 'ingest.db'}"
    upgrade(url)
    engine = make_engine(url)
    report = IngestConsumer(engine, broker.bootstrap, kafka_cfg, ingest_cfg, mode="assign").run(
        once=True, max_seconds=60
    )
    assert (report.stored, report.duplicates, report.dead_letters) == (2 * len(rows), 2 * len(rows), 0)
    assert stored_count(engine) == 2 * len(rows)

    labels = build_labels(load_sessions(engine), load_signals(engine), RewardsConfig(), datetime.now(UTC)).sessions
    sessions = load_sessions(engine).set_index(["user_id", "occurred_at"])
    for row in rows:  # each stored session is its row, and its label the row's
        stored = sessions.loc[(row["who"], START + timedelta(seconds=float(row["seconds"])))]
        assert (stored["completion_text"], stored["prompt_text"]) == (row["answer"], row["question"])
        assert stored["model"] == row["assistant"]
        assert labels.loc[stored["session_id"], "acceptance"] == float(row["copied"] == "yes")
    chats = {(r["who"], r["task"]) for r in rows}
    assert sessions["agent_session"].nunique() == len(chats) < len(rows)  # one chat per programmer and task
    with transaction(engine) as s:
        extras = list(s.scalars(select(SessionRow.extra)))
    assert sorted(e["served_logprobs"]["mean"] for e in extras) == sorted(float(r["lp"]) for r in rows)
    assert {e["source"] for e in extras} == {"rhe-export"}
    engine.dispose()


def test_json_lines_with_nested_keys_typed_labels_and_each_time_format(tmp_path: Path) -> None:
    base = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    records = [
        {"u": "a", "q": "sum a list", "r": "sum(xs)", "y": True, "t": base.timestamp(), "m": {"lp": -0.2}},
        {"u": "a", "q": "sort it", "r": "sorted(xs)", "y": 0, "t": base.timestamp() + 60, "m": {"lp": -1.5}},
        {"u": "b", "q": "max", "r": "max(xs)", "y": None, "t": base.timestamp() + 120, "m": {}},
        {"u": 7, "q": "min", "r": "min(xs)", "y": "Accepted", "t": base.timestamp() + 180},
    ]
    path = tmp_path / "log.ndjson"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    columns = ColumnMap.parse(["user=u,prompt=q,response=r,label=y", "time=t", "logprob=m.lp"])

    result = read_events(path, columns, time_format="unix", source="export")

    assert result.skipped == [] and (result.rows, result.sessions) == (4, 4)
    types = [e["type"] for e in result.events]
    session, accepted, rejected = "session.completed", "edit.accepted", "edit.rejected"
    assert types == [session, accepted, session, rejected, session, session, accepted]  # null: no signal
    sessions = session_records([e for e in result.events if e["type"] == "session.completed"])
    assert list(sessions["user_id"]) == ["a", "a", "b", "7"]
    assert [datetime.fromisoformat(e["occurred_at"]) for e in result.events if e["type"] == "session.completed"] == [
        base + timedelta(seconds=60 * i) for i in range(4)
    ]
    served = [e["payload"].get("served_logprobs") for e in result.events if e["type"] == "session.completed"]
    assert served == [{"mean": -0.2}, {"mean": -1.5}, None, None]
    assert signal_records(result.events)["session_id"].isin(sessions["session_id"]).all()

    millis = tmp_path / "ms.jsonl"
    millis.write_text("\n".join(json.dumps({**r, "t": r["t"] * 1000}) for r in records), encoding="utf-8")
    again = read_events(millis, columns, time_format="unix_ms", source="export")
    assert [e["event_id"] for e in again.events] == [e["event_id"] for e in result.events]  # same rows, same ids

    iso = tmp_path / "iso.tsv"
    write_csv(
        iso,
        [{"u": "c", "r": "x", "t": "2026-03-01T13:00:00+01:00"}, {"u": "c", "r": "y", "t": "2026-03-01T12:00"}],
        "\t",
    )
    both = read_events(iso, ColumnMap.parse(["user=u,response=r,time=t"]))
    assert [datetime.fromisoformat(e["occurred_at"]) for e in both.events] == [base, base]  # no offset: UTC
    assert both.signals == 0


def hostile_rows() -> list[tuple[str, str | None]]:
    """Lines of a JSON Lines file, each with the reason it must be skipped (None: kept)."""
    good = {"u": "u1", "q": "q", "r": "print(1)", "y": "yes", "t": "2026-01-01T00:00:00+00:00"}

    def line(**over: Any) -> str:
        return json.dumps({**good, **over})

    return [
        (line(), None),
        ("{not json", "not a JSON object"),
        ("[1, 2]", "a JSON list, not an object"),
        (line(u="", t="2026-01-01T00:00:01+00:00"), "user is empty"),
        (line(u="a\x00b", t="2026-01-01T00:00:02+00:00"), "control characters"),
        (line(r=None, t="2026-01-01T00:00:03+00:00"), "response is empty"),
        (line(y="maybe", t="2026-01-01T00:00:04+00:00"), "label 'maybe'"),
        (line(y=2, t="2026-01-01T00:00:05+00:00"), "label '2'"),
        (line(t="yesterday"), "not ISO 8601"),
        (line(t=""), "time is empty"),
        (line(lp=0.7, t="2026-01-01T00:00:06+00:00"), "positive"),
        (line(lp="NaN", t="2026-01-01T00:00:07+00:00"), "not finite"),
        (line(r="x" * 300_000, t="2026-01-01T00:00:08+00:00"), "oversized"),
        (line(q={"nested": 1}, t="2026-01-01T00:00:09+00:00"), "prompt is a JSON dict"),
        (line(mdl="a\nb", t="2026-01-01T00:00:10+00:00"), "model"),
        (line(), "the same identity as row 1"),
        (line(q="\ud800", t="2026-01-01T00:00:11+00:00"), "UTF-8"),
        (line(u="u2", t="2026-01-01T00:00:12+00:00"), None),
    ]


def test_malformed_and_hostile_rows_are_reported_by_row_and_reason_and_nothing_else_is_lost(tmp_path: Path) -> None:
    hostile = hostile_rows()
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(text for text, _ in hostile) + "\n", encoding="utf-8")
    columns = ColumnMap.parse(["user=u,prompt=q,response=r,label=y,time=t,logprob=lp,model=mdl"])

    result = read_events(path, columns, max_bytes=256 * 1024)

    expected = [(n, reason) for n, (_, reason) in enumerate(hostile, start=1) if reason is not None]
    assert [(s.row, s.line) for s in result.skipped] == [(n, n) for n, _ in expected]
    for skip, (_, reason) in zip(result.skipped, expected, strict=True):
        assert reason in skip.reason, (skip, reason)
    assert result.rows == len(hostile)
    assert {e["user_id"] for e in result.events} == {"u1", "u2"} and result.sessions == 2 == result.signals


def test_a_csv_row_with_a_cell_too_many_is_skipped_and_its_neighbours_kept(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text('user,answer\nu1,a\nu2,b,extra\nu3,"c\nd"\n', encoding="utf-8")

    result = read_events(path, ColumnMap.parse(["user=user,response=answer"]))

    assert [(s.row, s.line) for s in result.skipped] == [(2, 3)] and "3 cells" in result.skipped[0].reason
    texts = [e["payload"]["segments"][0]["text"] for e in result.events]
    assert texts == ["a", "c\nd"]


def test_ids_follow_the_rows_not_the_file_order_or_the_limit(tmp_path: Path) -> None:
    rows = flat_rows()[:40]
    columns = ColumnMap.parse([MAPPING])
    whole = read_events(write_csv(tmp_path / "a.csv", rows), columns, time_format="offset", start=START)
    shuffled = read_events(write_csv(tmp_path / "b.csv", rows[::-1]), columns, time_format="offset", start=START)
    part = read_events(write_csv(tmp_path / "c.csv", rows), columns, time_format="offset", start=START, limit=10)

    assert sorted(e["event_id"] for e in whole.events) == sorted(e["event_id"] for e in shuffled.events)
    assert {e["event_id"] for e in part.events} < {e["event_id"] for e in whole.events}
    assert part.rows == 10


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["user=u"], "required role(s) response"),
        (["user=u,response=r,colour=c"], "unknown role 'colour'"),
        (["user=u,response=r", "user=v"], "mapped twice"),
        (["user", "response=r"], "not role=column"),
    ],
)
def test_a_mapping_that_cannot_work_is_refused_with_what_to_fix(items: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ColumnMap.parse(items)


def test_a_file_without_the_mapped_columns_is_refused_before_any_row(tmp_path: Path) -> None:
    columns = ColumnMap.parse(["user=user,response=answer,label=accepted"])
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("user,answer\nu1,a\n", encoding="utf-8")
    with pytest.raises(FormatError, match=r"lacks the mapped column\(s\) accepted \(label\)"):
        read_events(csv_path, columns)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"uid": "u1", "answer": "a"}) + "\n", encoding="utf-8")
    with pytest.raises(FormatError, match=r"lacks the mapped key\(s\) user \(user\)"):
        read_events(jsonl, columns)
    empty = tmp_path / "empty.csv"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(FormatError, match="is empty"):
        read_events(empty, columns)
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_events(tmp_path / "t.parquet", columns)


def test_cli_dry_run_reports_without_a_broker_and_a_bad_mapping_exits_2(tmp_path: Path, kafka_cfg: KafkaConfig) -> None:
    rows = flat_rows()
    path = write_csv(tmp_path / "export.csv", rows)
    env = cli_env(tmp_path, None, kafka_cfg)  # no broker anywhere: a dry run must not need one

    done = undertow(
        ["import", "table", str(path), "--map", MAPPING, "--time-format", "offset", "--dry-run", "--json"], env
    )

    assert done.returncode == 0, done.stderr
    summary = last_json(done.stdout)
    assert (summary["rows"], summary["sessions"], summary["sent"], summary["dry_run"]) == (
        len(rows),
        len(rows),
        0,
        True,
    )
    assert summary["columns"]["label"] == "copied"

    bad = undertow(["import", "table", str(path), "--map", "user=who", "--dry-run"], env)
    assert bad.returncode == 2 and "required role(s) response" in bad.stderr
    missing = undertow(["import", "table", str(path), "--map", "user=who,response=nope", "--dry-run"], env)
    assert missing.returncode == 2 and "nope (response)" in missing.stderr
    wrong_time = undertow(["import", "table", str(path), "--map", MAPPING, "--time-format", "weeks", "--dry-run"], env)
    assert wrong_time.returncode == 2 and "unknown time format 'weeks'" in wrong_time.stderr
