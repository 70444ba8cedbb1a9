"""Policy versions: the ``policy_versions`` rows and the offline train-a-version pipeline.

Version ids are ``v0000`` (the warm-up) then ``v0001``, ``v0002``, ... in lineage order; a
version's number is its distance in updates from v0, which is what staleness is counted in.
A checkpoint directory is complete before its row is written (the row is the completion
marker): readers that find a row find a loadable checkpoint.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import as_utc, transaction
from policy.tables import PolicyVersionRow


def version_id(number: int) -> str:
    """``v0007`` for 7."""
    return f"v{number:04d}"


def latest_version(engine: Engine) -> PolicyVersionRow | None:
    """The newest version row (by creation time, then id), or None."""
    with transaction(engine) as db:
        stmt = select(PolicyVersionRow).order_by(PolicyVersionRow.created_at.desc(), PolicyVersionRow.version_id.desc())
        row = db.scalars(stmt.limit(1)).first()
        if row is not None:
            db.expunge(row)
        return row


def list_versions(engine: Engine) -> list[PolicyVersionRow]:
    """Every version row, oldest first."""
    with transaction(engine) as db:
        stmt = select(PolicyVersionRow).order_by(PolicyVersionRow.created_at, PolicyVersionRow.version_id)
        rows = list(db.scalars(stmt))
        for r in rows:
            db.expunge(r)
        return rows


def lineage(engine: Engine, version: str) -> list[str]:
    """``version`` and its ancestors by ``parent_id``, newest first (a version rolled back and never
    built on is no one's ancestor)."""
    with transaction(engine) as db:
        parents = dict(db.execute(select(PolicyVersionRow.version_id, PolicyVersionRow.parent_id)).tuples().all())
    out: list[str] = []
    current: str | None = version
    while current is not None and current not in out:
        out.append(current)
        current = parents.get(current)
    return out


def record_version(
    engine: Engine,
    *,
    version: str,
    parent: str | None,
    step: int,
    checkpoint_path: str | Path,
    metrics: dict[str, Any],
    num_samples: int = 0,
    num_dropped_stale: int = 0,
    staleness_mean: float | None = None,
    staleness_max: int | None = None,
    data_start: datetime | None = None,
    data_end: datetime | None = None,
) -> PolicyVersionRow:
    """Insert a version row (after its checkpoint is on disk); a duplicate id raises."""
    if not (Path(checkpoint_path) / "config.json").exists():
        raise FileNotFoundError(f"checkpoint {checkpoint_path} is incomplete; save it before recording the version")
    row = PolicyVersionRow(
        version_id=version,
        parent_id=parent,
        step=step,
        data_start=data_start,
        data_end=data_end,
        num_samples=num_samples,
        num_dropped_stale=num_dropped_stale,
        staleness_mean=staleness_mean,
        staleness_max=staleness_max,
        metrics=metrics,
        checkpoint_path=str(checkpoint_path),
        created_at=datetime.now(UTC),
    )
    with transaction(engine) as db:
        if db.get(PolicyVersionRow, version) is not None:
            raise ValueError(f"policy version {version} already exists; versions are immutable")
        db.add(row)
        db.flush()
        db.expunge(row)
    return row


def flag_trained_on(session: Session, times: list[tuple[datetime, datetime]]) -> list[str]:
    """Flag the versions trained on a forgotten user's rollouts (``times``: their ``(occurred_at,
    received_at)``), and every descendant of one (its weights carry the update on); returns their ids.

    A version trained on a rollout when the rollout lies in its data window (``data_start`` .. ``data_end``)
    and was stored before the version was created: conservative, as the window is what the table records
    of the training data. Versions trained on offline task data only (no window) are not flagged.
    """
    if not times:
        return []
    rows = list(session.scalars(select(PolicyVersionRow)))
    direct: set[str] = set()
    for row in rows:
        if row.data_start is None or row.data_end is None:
            continue
        start, end, created = as_utc(row.data_start), as_utc(row.data_end), as_utc(row.created_at)
        if any(start <= as_utc(o) <= end and as_utc(r) <= created for o, r in times):
            direct.add(row.version_id)
    children: dict[str, list[str]] = {}
    for row in rows:
        if row.parent_id is not None:
            children.setdefault(row.parent_id, []).append(row.version_id)
    flagged, todo = set(direct), list(direct)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in flagged:
                flagged.add(child)
                todo.append(child)
    for row in rows:
        if row.version_id in flagged:
            row.trained_on_forgotten = (row.trained_on_forgotten or 0) + 1
    return sorted(flagged)


def add_metrics(engine: Engine, version: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """Add metrics measured after a version was recorded (a held-out evaluation run later) to its row.

    The weights and lineage stay immutable; metrics already on the row are never overwritten, so a
    later measurement cannot rewrite what the version was gated or reported on. Returns the row's
    metrics after the merge."""
    with transaction(engine) as db:
        row = db.get(PolicyVersionRow, version)
        if row is None:
            raise ValueError(f"policy version {version} is not recorded; nothing to add metrics to")
        merged = {**metrics, **dict(row.metrics or {})}
        row.metrics = merged
        return dict(merged)
