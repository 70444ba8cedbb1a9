"""Replica leases and the job table on SQLite and PostgreSQL: exclusive and idempotent leases,
renewal, recall, release, expiry; borrowing walks the state machine through the fleet."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from scheduler_helpers import FileFleet
from sqlalchemy import select

from ingest.db import transaction
from scheduler.loop import leases
from scheduler.loop.borrowing import VersionMismatch, give_back, lend, reap
from scheduler.loop.jobs import list_jobs, mark_lost, record
from scheduler.planner.borrow import IllegalTransition, ReplicaState
from scheduler.tables import BorrowEventRow, JobRow


@pytest.fixture
def lite(sqlite_url: str) -> Iterator[Any]:
    """A migrated SQLite engine (the tests that only drive the fleet need no second backend)."""
    from ingest.db import make_engine, upgrade

    upgrade(sqlite_url)
    eng = make_engine(sqlite_url)
    yield eng
    eng.dispose()


def _events(engine: Any) -> list[str]:
    with transaction(engine) as s:
        return [e.event for e in s.scalars(select(BorrowEventRow).order_by(BorrowEventRow.id)).all()]


def test_lease_is_exclusive_idempotent_and_expires(engine: Any) -> None:
    t0 = datetime.now(UTC)
    assert leases.acquire(engine, "r1", "p", "job-a", "training", 10, now=t0)
    assert leases.acquire(engine, "r1", "p", "job-a", "training", 10, now=t0)  # same holder: renew
    assert not leases.acquire(engine, "r1", "p", "job-b", "training", 10, now=t0)
    st = leases.renew(engine, "r1", "job-a", 10)
    assert not st.recall_requested
    with pytest.raises(leases.LeaseLost):
        leases.renew(engine, "r1", "job-b", 10)
    assert leases.reap_expired(engine, now=t0 + timedelta(seconds=5)) == []
    later = datetime.now(UTC) + timedelta(seconds=11)
    assert leases.reap_expired(engine, now=later) == [("r1", "p", "job-a", "training")]
    with pytest.raises(leases.LeaseLost):
        leases.renew(engine, "r1", "job-a", 10)
    assert leases.acquire(engine, "r1", "p", "job-b", "generation", 10)  # free again
    assert leases.active_leases(engine)[0]["holder"] == "job-b"
    assert _events(engine) == ["lent", "expired", "lent"]


def test_recall_and_release(engine: Any) -> None:
    assert leases.acquire(engine, "r2", "p", "job", "training", 30)
    assert leases.request_recall(engine, ["r2", "unknown"], deadline_s=60) == ["r2"]
    assert leases.request_recall(engine, ["r2"], deadline_s=60) == ["r2"]  # asking twice logs once
    st = leases.renew(engine, "r2", "job", 30)
    assert st.recall_requested and st.recall_deadline is not None
    assert leases.release(engine, "r2", "job", event="preempted")
    assert not leases.release(engine, "r2", "job")  # idempotent
    with transaction(engine) as s:
        last = s.scalars(select(BorrowEventRow).order_by(BorrowEventRow.id.desc())).first()
        assert last is not None and last.event == "preempted" and last.detail["within_deadline"] is True
    assert _events(engine) == ["lent", "recalled", "preempted"]
    assert leases.active_leases(engine) == []


def test_state_machine_is_enforced_on_leases(lite: Any) -> None:
    engine = lite
    assert leases.acquire(engine, "r3", "p", "job", "training", 30)
    with pytest.raises(IllegalTransition):
        leases.set_state(engine, "r3", "job", ReplicaState.VERIFYING)  # draining cannot skip to verifying
    leases.set_state(engine, "r3", "job", ReplicaState.SLEEPING)
    with pytest.raises(leases.LeaseLost):
        leases.set_state(engine, "r3", "other", ReplicaState.LENT)


def test_lend_and_give_back_drive_the_fleet(lite: Any, tmp_path: Path) -> None:
    engine = lite
    fleet = FileFleet.create(tmp_path, n=2)
    assert lend(fleet, engine, "r0", "default", "job", "training", 30)
    assert lend(fleet, engine, "r0", "default", "job", "training", 30)  # a re-run does not drain twice
    assert not lend(fleet, engine, "r0", "default", "other", "training", 30)
    assert lend(fleet, engine, "r1", "default", "job", "generation", 30)
    give_back(fleet, engine, "r1", "default", "job", generation=True)
    give_back(fleet, engine, "r0", "default", "job")
    calls = [(c[0], c[1]) for c in fleet.read()["calls"]]
    assert calls == [
        ("drain", "r0"),
        ("sleep", "r0"),
        ("drain", "r1"),
        ("rejoin", "r1"),
        ("wake", "r0"),
        ("rejoin", "r0"),
    ]
    # A replica that comes back with the wrong weights is not put back in rotation.
    assert lend(fleet, engine, "r0", "default", "job2", "training", 30)
    with fleet._edit() as s:
        s["replicas"]["r0"]["version"] = "stale"
    with pytest.raises(VersionMismatch, match="stale"):
        give_back(fleet, engine, "r0", "default", "job2")
    assert fleet.read()["replicas"]["r0"]["state"] == "awake"


def test_reaper_returns_replicas_and_marks_the_job_lost(lite: Any, tmp_path: Path) -> None:
    engine = lite
    fleet = FileFleet.create(tmp_path, n=1)
    record(engine, "job-x", name="undertow.rl_update", state="STARTED", started_at=datetime.now(UTC))
    assert lend(fleet, engine, "r0", "default", "job-x", "training", 0.01)
    import time

    time.sleep(0.05)
    assert reap(fleet, engine) == ["r0"]
    assert fleet.read()["replicas"]["r0"]["state"] == "serving"
    assert list_jobs(engine)[0]["state"] == "LOST"
    assert not mark_lost(engine, "job-x", "again")  # only a STARTED job can be lost


def test_job_rows_keep_inputs_outputs_and_timings(lite: Any) -> None:
    engine = lite
    record(engine, "t1", name="undertow.collect", state="STARTED", inputs={"args": [{"run_id": "r"}]}, attempts=1)
    record(engine, "t1", state="SUCCESS", outputs={"x": object()}, duration_s=0.5)
    with transaction(engine) as s:
        row = s.get(JobRow, "t1")
        assert row is not None and row.state == "SUCCESS" and row.inputs == {"args": [{"run_id": "r"}]}
        assert isinstance(row.outputs["x"], str) and row.duration_s == 0.5
    assert [j["id"] for j in list_jobs(engine, state="SUCCESS")] == ["t1"]
    assert list_jobs(engine, state="FAILURE") == []
