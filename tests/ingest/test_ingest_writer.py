"""Idempotent writes, signal columns, late/early joins and stats, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from ingest_helpers import raw, session_event, signal_event
from sqlalchemy import func, select

from ingest.arrays import npy_load, npy_to_b64, unpack_floats, unpack_ids
from ingest.db import transaction
from ingest.joins import orphan_signal_counts, signals_by_session
from ingest.schemas import parse_event
from ingest.stats import stats
from ingest.tables import DuplicateRow, SegmentRow, SessionRow, SignalRow
from ingest.writer import Delivery, load_offsets, store_offsets, write_events


def ev(event: dict[str, Any]) -> Any:
    return parse_event(raw(event))


def test_idempotent_across_and_within_batches(engine: Any) -> None:
    a, b = ev(session_event(1)), ev(session_event(2))
    sig = ev(signal_event("sig-1", "feedback.thumbs", "sess-7-1", {"value": 1}))
    with transaction(engine) as s:
        first = write_events(s, [Delivery(a, "t", 0, 10), Delivery(a, "t", 0, 11), sig, b])
    assert (first.stored, first.duplicates) == (3, 1)
    assert first.duplicate_ids == [a.event_id]
    with transaction(engine) as s:
        second = write_events(s, [sig, a, ev(session_event(3))])
    assert (second.stored, second.duplicates) == (1, 2)
    with transaction(engine) as s:
        assert s.scalar(select(func.count()).select_from(SessionRow)) == 3
        assert s.scalar(select(func.count()).select_from(SignalRow)) == 1
        dupes = s.execute(select(DuplicateRow).order_by(DuplicateRow.id)).scalars().all()
        assert (dupes[0].event_id, dupes[0].topic, dupes[0].partition, dupes[0].offset) == (a.event_id, "t", 0, 11)
        assert len(dupes) == 3


def test_same_session_under_a_new_event_id_is_a_duplicate(engine: Any) -> None:
    one = ev(session_event(1))
    resent = ev(session_event(1, event_id="another-id"))
    with transaction(engine) as s:
        result = write_events(s, [one, resent])
    assert (result.stored, result.duplicates) == (1, 1)
    with transaction(engine) as s:
        result = write_events(s, [ev(session_event(1, event_id="third-id"))])
    assert (result.stored, result.duplicates) == (0, 1)


def test_a_session_sent_again_under_a_new_id_does_not_cost_its_batch_mates(engine: Any) -> None:
    """PostgreSQL writes a batch with COPY, which cannot skip a row: a session stored before under another
    event id makes the batch fall back to inserts that skip conflicts. Its batch-mates are stored all the
    same, with their segments, and only the re-sent session counts as a duplicate."""
    with transaction(engine) as s:
        write_events(s, [ev(session_event(1))])
    batch = [
        ev(session_event(1, event_id="again")),
        ev(session_event(2)),
        ev(signal_event("sig-9", "feedback.thumbs", "sess-7-2", {"value": -1})),
    ]
    with transaction(engine) as s:
        result = write_events(s, batch)
    assert (result.stored, result.duplicates, result.duplicate_ids) == (2, 1, ["again"])
    with transaction(engine) as s:
        assert set(s.scalars(select(SessionRow.event_id))) == {"ev-7-1", "ev-7-2"}
        assert s.scalar(select(func.count()).where(SegmentRow.session_id == "sess-7-2")) == len(
            session_event(2)["payload"]["segments"]
        )
        assert list(s.scalars(select(SignalRow.value))) == [-1.0]


def test_session_columns_are_bit_exact(engine: Any) -> None:
    event = session_event(4)
    experts = np.random.default_rng(0).integers(0, 16, (13, 3, 2)).astype(np.int32)
    event["payload"].update(
        routed_experts=npy_to_b64(experts),
        group_id="grp",
        candidate_index=1,
        sampling={"temperature": 0.8, "logprobs_mode": "processed"},
        files=[{"path": "a.py", "lines_added": 3, "lines_removed": 1}],
        custom="kept",
    )
    event["payload"]["segments"].insert(0, {"role": "user", "text": "please"})
    logprobs = [-1e-300, -0.1 + 1e-17, -3.3333333333333335, 0.0, -12.5, -7e-5]
    event["payload"]["segments"][1]["logprobs"] = logprobs
    with transaction(engine) as s:
        write_events(s, [ev(event)])
    with transaction(engine) as s:
        row = s.get(SessionRow, event["session_id"])
        assert row is not None
        assert np.array_equal(npy_load(row.routed_experts or b""), experts)
        assert (row.group_id, row.candidate_index, row.logprobs_mode) == ("grp", 1, "processed")
        assert row.extra["custom"] == "kept" and row.extra["files"][0]["path"] == "a.py"
        assert row.completion_text == event["payload"]["segments"][1]["text"]
        assert row.num_completion_tokens == 6
        segs = s.execute(select(SegmentRow).where(SegmentRow.session_id == row.session_id).order_by(SegmentRow.idx))
        user, assistant = segs.scalars().all()
        assert (user.role, user.text, user.token_ids, user.logprobs) == ("user", "please", None, None)
        assert unpack_floats(assistant.logprobs).tolist() == logprobs
        assert unpack_ids(assistant.token_ids).tolist() == event["payload"]["segments"][1]["token_ids"]
        assert unpack_ids(row.prompt_token_ids).tolist() == event["payload"]["prompt"]["token_ids"]


def test_signal_columns(engine: Any) -> None:
    events = [
        signal_event("r1", "code.retained", "s1", {"horizon_s": 300, "lines_written": 4, "lines_retained": 3}),
        signal_event("r2", "code.retained", "s1", {"horizon_s": 86400, "lines_written": 0, "lines_retained": 0}),
        signal_event("t1", "feedback.thumbs", "s1", {"value": -1}),
        signal_event("e1", "edit.rejected", "s1", {"lines": 7}),
        signal_event("c1", "candidates.shown", "s1", {"group_id": "g", "session_ids": ["s1", "s2", "s3"]}),
        signal_event("c2", "candidate.selected", "s2", {"group_id": "g", "chosen_session_id": "s2"}),
        signal_event("u1", "user.churned", None, {"inactive_days": 14}),
    ]
    with transaction(engine) as s:
        write_events(s, [ev(e) for e in events])
    with transaction(engine) as s:
        rows = {r.event_id: r for r in s.execute(select(SignalRow)).scalars()}
    assert (rows["r1"].horizon_s, rows["r1"].value) == (300, 0.75)
    assert (rows["r2"].horizon_s, rows["r2"].value) == (86400, None)
    assert rows["t1"].value == -1.0
    assert rows["e1"].value == 7.0
    assert (rows["c1"].group_id, rows["c1"].value) == ("g", 3.0)
    assert (rows["c2"].group_id, rows["c2"].session_id) == ("g", "s2")
    assert (rows["u1"].session_id, rows["u1"].value, rows["u1"].user_id) == (None, 14.0, "user-1")
    assert rows["c1"].payload == {"group_id": "g", "session_ids": ["s1", "s2", "s3"]}
    assert rows["r1"].occurred_at.replace(tzinfo=None).isoformat() == "2025-01-06T11:05:00"  # stored as UTC


def test_early_signals_join_when_the_session_arrives(engine: Any) -> None:
    sid = "sess-7-9"
    early = [
        signal_event("x1", "edit.accepted", sid, {"lines": 2}),
        signal_event("x2", "code.retained", sid, {"horizon_s": 300, "lines_written": 2, "lines_retained": 2}),
    ]
    with transaction(engine) as s:
        write_events(s, [ev(e) for e in early])
    assert orphan_signal_counts(engine) == {"code.retained": 1, "edit.accepted": 1}
    assert signals_by_session(engine)[sid].arrived is False

    with transaction(engine) as s:
        write_events(s, [ev(session_event(9))])
    late = signal_event("x3", "code.retained", sid, {"horizon_s": 86400, "lines_written": 2, "lines_retained": 1})
    late["occurred_at"] = "2025-01-07T12:00:00Z"
    with transaction(engine) as s:
        write_events(s, [ev(late), ev(late)])
    assert orphan_signal_counts(engine) == {}
    joined = signals_by_session(engine, [sid])[sid]
    assert joined.arrived
    assert [v.type for v in joined.signals] == ["edit.accepted", "code.retained", "code.retained"]
    assert joined.horizons() == {300: 1.0, 86400: 0.5}
    assert stats(engine) == {
        "events": {"session.completed": 1, "code.retained": 2, "edit.accepted": 1},
        "sessions": 1,
        "duplicates": 1,
        "dead_letters": 0,
        "unreadable_batches": {
            "count": 0,
            "last_at": None,
            "last_reason": None,
            "last_topic": None,
            "last_partition": None,
            "last_offset": None,
            "last_detail": None,
            "held_partitions": [],
        },
    }


def test_offsets_upsert_and_cluster_epoch(engine: Any) -> None:
    with transaction(engine) as s:
        store_offsets(s, "g", {("t", 0): 5, ("t", 1): 7}, cluster_id="c1")
    with transaction(engine) as s:
        store_offsets(s, "g", {("t", 0): 9}, cluster_id="c2")
    with transaction(engine) as s:
        assert load_offsets(s, "g", "t") == {0: 9, 1: 7}
        assert load_offsets(s, "g", "t", cluster_id="c2") == {0: 9}
        assert load_offsets(s, "other", "t") == {}


def test_concurrent_writers_store_each_event_once(engine: Any) -> None:
    events = [ev(session_event(i)) for i in range(200)] + [
        ev(signal_event(f"sg-{i}", "feedback.thumbs", f"sess-7-{i}", {"value": 1})) for i in range(200)
    ]
    results: list[Any] = []
    errors: list[BaseException] = []

    def work(order: list[Any]) -> None:
        try:
            for start in range(0, len(order), 50):
                with transaction(engine) as s:
                    results.append(write_events(s, order[start : start + 50]))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(list(o),)) for o in (events, events[::-1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(r.stored for r in results) == 400
    assert sum(r.duplicates for r in results) == 400
    assert stats(engine)["sessions"] == 200


def test_the_duplicate_lookup_is_never_a_cached_generic_plan(engine: Any) -> None:
    """psycopg prepares a statement from its fifth run; a generic plan for the lookup made while
    the table was nearly empty would scan the whole table on every later batch."""
    from sqlalchemy import text

    from ingest.writer import existing_event_ids

    events = [ev(session_event(i)) for i in range(20)]
    with transaction(engine) as s:
        write_events(s, events)
    stored = {events[3].event_id, events[19].event_id}
    with transaction(engine) as s:
        for _ in range(8):
            assert existing_event_ids(s, [*stored, "not-stored"]) == stored
        if engine.dialect.name == "postgresql":
            prepared = s.execute(text("SELECT statement FROM pg_prepared_statements")).scalars().all()
            assert not [q for q in prepared if "SELECT event_id" in q], prepared


def test_a_sampled_nul_character_is_stored_on_both_databases(engine: Any) -> None:
    """A model can sample ``\\x00``; PostgreSQL text cannot hold it, and the batch must not fail forever.
    The text keeps a visible U+FFFD there (SQLite keeps the NUL); the token ids stay exact."""
    event = session_event(1)
    event["payload"]["prompt"]["text"] = "Write\x00 a function."
    for seg in event["payload"]["segments"]:
        seg["text"] = (seg["text"] or "") + "\x00tail"
    with transaction(engine) as s:
        assert write_events(s, [ev(event)]).stored == 1
    nul = "\x00" if engine.dialect.name == "sqlite" else "\ufffd"
    with transaction(engine) as s:
        row = s.scalars(select(SessionRow)).one()
        assert row.prompt_text == f"Write{nul} a function." and row.completion_text.endswith(f"{nul}tail")
        segments = s.scalars(select(SegmentRow).order_by(SegmentRow.idx)).all()
        assert all(seg.text.endswith(f"{nul}tail") for seg in segments)
        assert [unpack_ids(seg.token_ids).tolist() for seg in segments] == [
            seg["token_ids"] for seg in event["payload"]["segments"]
        ]


def test_the_copy_streams_are_the_bytes_psycopg_sends(engine: Any) -> None:
    """PostgreSQL's batches go in as binary COPY streams built without a connection (:mod:`ingest.pgcopy`);
    psycopg's own binary COPY of the same rows, on a live connection, gives the same bytes."""
    if engine.dialect.name != "postgresql":
        pytest.skip("binary COPY is PostgreSQL's")
    from psycopg.copy import Copy, Writer
    from psycopg.types.json import Json

    from ingest.rows import codec_for
    from ingest.writer import _COPY, copy_streams, new_rows, prepare_events

    class Collect(Writer):
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, data: Any) -> None:
            self.data += data

    full = session_event(5, user_id=None)
    full["payload"].update(
        routed_experts=npy_to_b64(np.arange(12, dtype=np.int32).reshape(2, 3, 2)),
        group_id="grp-é",
        candidate_index=3,
        latency_ms=12.5,
        finish_reason="stop",
        sampling={"temperature": 0.7},
    )
    full["payload"]["prompt"]["text"] = "naïve – 日本\x00"
    events = [
        full,
        session_event(6, occurred_at="1999-12-31T23:59:59.999999-05:00"),
        signal_event("r9", "code.retained", "s9", {"horizon_s": 86400, "lines_written": 3, "lines_retained": 1}),
        signal_event("u9", "user.churned", None, {"inactive_days": 2**31 - 1}),
    ]
    prepared = prepare_events(codec_for("postgresql"), [ev(e) for e in events])
    rows = new_rows(prepared.first, set())
    streams = copy_streams(rows)
    assert prepared.copied is not None and prepared.copied[1] == streams
    assert set(streams) == {"sessions", "session_segments", "signals"}
    expected_rows = {"sessions": rows.sessions, "session_segments": rows.segment_rows(), "signals": rows.signals}
    with engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        for name, table_rows in expected_rows.items():
            types = _COPY[name].types
            writer = Collect()
            with Copy(cursor, binary=True, writer=writer) as copy:
                copy.set_types(types)
                for row in table_rows:  # psycopg would dump a str for a json column as a JSON string: wrap it
                    copy.write_row([Json(v, dumps=str) if t == "json" else v for v, t in zip(row, types, strict=True)])
            assert streams[name] == bytes(writer.data), name


@pytest.mark.parametrize("answer_lost", [True, False], ids=["committed", "not-committed"])
def test_a_commit_whose_answer_is_lost_is_not_written_again(engine: Any, answer_lost: bool) -> None:
    """The connection can drop during ``COMMIT`` after the server committed: the writer sees an error and
    retries. The retry must find that the batch is in and report what that commit did: the events it
    stored are not recorded again as duplicates of themselves, and the real duplicates stay counted once.
    A commit that did fail is written again in full."""
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    from ingest.batches import BatchContext, commit_batch, prepare_batch
    from ingest.rows import codec_for

    with transaction(engine) as s:
        write_events(s, [ev(session_event(1))])
    batch = [session_event(1), session_event(2), signal_event("sig-9", "feedback.thumbs", "sess-7-2", {"value": 1})]
    batch.append(session_event(2))  # a second delivery within the batch
    records = [("t", 0, 5 + i, None, raw(e)) for i, e in enumerate(batch)]
    ctx = BatchContext("g", 1 << 20, 0.01, 0.05)
    prepared, letters = prepare_batch(codec_for(engine.dialect.name), ctx, records)
    faults: list[str] = []

    def drop_connection(session: Any) -> None:
        if not faults:
            faults.append("dropped")
            raise OperationalError("COMMIT", None, Exception("the connection is lost"))

    hook = "after_commit" if answer_lost else "before_commit"
    event.listen(Session, hook, drop_connection)
    retries: list[str] = []
    try:
        done = commit_batch(
            engine, ctx, prepared, letters, {("t", 0): 9}, None, threading.Event(), lambda e, d: retries.append(e)
        )
    finally:
        event.remove(Session, hook, drop_connection)
    assert faults == ["dropped"] and retries == ["the connection is lost"]
    assert done is not None
    assert (done.result.stored, done.result.duplicates) == (2, 2)
    assert sorted(done.result.stored_ids) == [batch[1]["event_id"], "sig-9"]
    with transaction(engine) as s:
        dupes = s.execute(select(DuplicateRow.offset).order_by(DuplicateRow.offset)).scalars().all()
        assert dupes == [5, 8]
        assert s.scalar(select(func.count()).select_from(SessionRow)) == 2
        assert s.scalar(select(func.count()).select_from(SignalRow)) == 1
        assert load_offsets(s, "g", "t") == {0: 9}
