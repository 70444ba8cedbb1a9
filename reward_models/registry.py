"""The registry: reward-model versions in a table, their bundles as content-hashed artifacts.

An artifact is the pickled :class:`~reward_models.models.RewardBundle` stored as
``<artifacts_dir>/<sha256>.pkl``; the row keeps the hash, and loading refuses a file whose bytes
no longer match it (a swapped or corrupted artifact never scores). Artifacts are only ever
loaded from the project's own artifact directory, written by :func:`save_bundle`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import as_utc, transaction
from reward_models.models import RewardBundle
from reward_models.tables import RewardModelRow

PROMOTED = "promoted"
CANDIDATE = "candidate"
RETIRED = "retired"


class UnknownVersion(LookupError):
    """No such reward-model version (or none promoted yet); the message says what to run."""


class CorruptArtifact(RuntimeError):
    """An artifact's bytes no longer match the hash recorded in the registry."""


def save_bundle(bundle: RewardBundle, artifacts_dir: Path) -> tuple[str, Path]:
    """Write ``bundle`` as ``<sha256>.pkl`` (atomically: temp file, then rename); returns (hash, path)."""
    raw = pickle.dumps(bundle, protocol=pickle.HIGHEST_PROTOCOL)
    digest = hashlib.sha256(raw).hexdigest()
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    path = artifacts_dir / f"{digest}.pkl"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(raw)
        tmp.replace(path)
    return digest, path.resolve()


def load_bundle(row: RewardModelRow) -> RewardBundle:
    """The bundle of ``row``, after checking its bytes against the recorded hash."""
    path = Path(row.artifact_path)
    if not path.exists():
        raise CorruptArtifact(
            f"Artifact of reward model {row.version} is missing at {path}; retrain with `undertow rewards train`."
        )
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != row.artifact_sha256:
        raise CorruptArtifact(
            f"Artifact of reward model {row.version} at {path} does not match its recorded hash; retrain."
        )
    bundle = pickle.loads(raw)  # our own artifact, verified against the registry's hash above
    if not isinstance(bundle, RewardBundle):
        raise CorruptArtifact(f"Artifact of reward model {row.version} is not a reward bundle.")
    return bundle


def next_version_id(engine: Engine, digest: str) -> str:
    """``rm-<n>-<hash8>``, ``n`` one more than the number of versions so far."""
    with engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(RewardModelRow)).scalar_one()
    return f"rm-{count + 1:04d}-{digest[:8]}"


def get_version(engine: Engine, version: str = "latest") -> RewardModelRow:
    """The row of ``version``; ``latest`` is the most recently promoted one."""
    with transaction(engine) as session:
        if version == "latest":
            row = session.execute(
                select(RewardModelRow)
                .where(RewardModelRow.status == PROMOTED)
                .order_by(RewardModelRow.promoted_at.desc(), RewardModelRow.created_at.desc())
                .limit(1)
            ).scalar_one_or_none()
            if row is None:
                raise UnknownVersion("No reward model has been promoted yet; run `undertow rewards train` first.")
        else:
            row = session.get(RewardModelRow, version)
            if row is None:
                raise UnknownVersion(f"Unknown reward model version {version!r}; see `undertow rewards list`.")
        session.expunge(row)
        return row


def current_promoted(engine: Engine) -> RewardModelRow | None:
    """The promoted version in force, or None."""
    try:
        return get_version(engine, "latest")
    except UnknownVersion:
        return None


def trained_by(engine: Engine, job_id: str, recent: int = 500) -> RewardModelRow | None:
    """The version a job already registered (its resolved config names the job), among the most recent."""
    with Session(engine) as db:
        rows = db.scalars(select(RewardModelRow).order_by(RewardModelRow.created_at.desc()).limit(recent))
        for row in rows:
            if (row.config or {}).get("job_id") == job_id:
                db.expunge(row)
                return row
    return None


def list_versions(engine: Engine) -> list[dict[str, Any]]:
    """Every version, newest first, as plain data."""
    table = RewardModelRow.__table__
    keys = [
        "version",
        "created_at",
        "status",
        "backend",
        "primary_metric",
        "n_labeled",
        "window_start",
        "window_end",
        "reason",
        "trained_on_forgotten",
    ]
    with engine.connect() as conn:
        rows = conn.execute(select(*(table.c[k] for k in keys)).order_by(table.c.created_at.desc())).mappings().all()
    return [dict(r) for r in rows]


def register(
    engine: Engine,
    *,
    version: str,
    bundle_hash: str,
    path: Path,
    backend: str,
    status: str,
    reason: str,
    window: tuple[datetime | None, datetime | None],
    n_labeled: int,
    primary_metric: float | None,
    config: dict[str, Any],
    metrics: dict[str, Any],
    reference_scores: list[float],
    now: datetime | None = None,
) -> RewardModelRow:
    """Insert a version; when ``status`` is promoted, retire the previously promoted one in the same transaction."""
    now = now or datetime.now(UTC)
    row = RewardModelRow(
        version=version,
        created_at=now,
        backend=backend,
        status=status,
        reason=reason,
        artifact_sha256=bundle_hash,
        artifact_path=str(path),
        window_start=window[0],
        window_end=window[1],
        n_labeled=n_labeled,
        primary_metric=primary_metric,
        config=config,
        metrics=metrics,
        reference_scores=reference_scores,
        promoted_at=now if status == PROMOTED else None,
    )
    with transaction(engine) as session:
        if status == PROMOTED:
            for old in session.execute(select(RewardModelRow).where(RewardModelRow.status == PROMOTED)).scalars():
                old.status = RETIRED
        session.add(row)
    return row


def _covers(
    start: datetime | None, end: datetime | None, created: datetime, times: list[tuple[datetime, datetime]]
) -> bool:
    """True when one ``(occurred_at, received_at)`` falls in ``[start, end]`` and was stored before ``created``."""
    created = as_utc(created)
    for occurred, received in times:
        if as_utc(received) > created:
            continue
        if start is not None and as_utc(occurred) < as_utc(start):
            continue
        if end is not None and as_utc(occurred) > as_utc(end):
            continue
        return True
    return False


def flag_trained_on(session: Session, times: list[tuple[datetime, datetime]]) -> list[str]:
    """Flag the versions whose training data held a forgotten user's sessions (``times``: their
    ``(occurred_at, received_at)``); returns their ids.

    A version was trained on a session when the session lies in the version's data window
    (``window_start`` .. ``window_end``, the oldest and newest session ``occurred_at`` it trained on) and
    had been stored before the version was created. That is conservative: a session in the window
    without a label, or left out by the per-user share cap, counts too; the rows themselves are not
    recorded per version, and the window with the creation time is the registry's record of them.
    """
    if not times:
        return []
    flagged = []
    for row in session.scalars(select(RewardModelRow)):
        if row.n_labeled and _covers(row.window_start, row.window_end, row.created_at, times):
            row.trained_on_forgotten = (row.trained_on_forgotten or 0) + 1
            flagged.append(row.version)
    return sorted(flagged)
