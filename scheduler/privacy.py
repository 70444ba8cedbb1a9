"""Users' data, wired across the layers: forgetting a user, and the retention sweep.

:func:`forget` runs in one transaction: the exclusive ingest lock (:func:`ingest.forget.lock_exclusive`),
the user's session times, the reward-model and policy versions trained on them flagged in their
registries, the rows deleted and the tombstone written. ``undertow users forget`` and
``DELETE /api/v1/users/{user_id}`` call it; the ``undertow.enforce_retention`` beat job calls
:func:`enforce_retention`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import column, delete, select, table

from ingest import forget as forgetting
from ingest.db import UTCDateTime, transaction

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from scheduler.settings import Settings


def forget(engine: Engine, user_id: str, requested_by: str) -> dict[str, Any]:
    """Forget ``user_id`` (see the module docstring); what was deleted and flagged, as plain data."""
    from policy.versions import flag_trained_on as flag_policies
    from reward_models.registry import flag_trained_on as flag_reward_models

    with transaction(engine) as session:
        forgetting.lock_exclusive(session)
        times = forgetting.user_session_times(session, user_id)
        flagged = {
            "reward_models": flag_reward_models(session, times),
            "policy_versions": flag_policies(session, times),
        }
        done = forgetting.forget_user(session, user_id, requested_by)
        forgetting.record_flagged(session, done.user_hash, flagged)
    return {"user_hash": done.user_hash, "deleted": done.deleted, "flagged": flagged}


def enforce_retention(engine: Engine, settings: Settings, now: datetime | None = None) -> dict[str, Any]:
    """Delete telemetry older than ``ingest.retention_days`` and audit entries older than
    ``api.audit_retention_days`` (a setting of 0 keeps them)."""
    from ingest.retention import delete_older_than

    now = now or datetime.now(UTC)
    out: dict[str, Any] = {"telemetry": None, "audit": None}
    if settings.ingest.retention_days > 0:
        out["telemetry"] = delete_older_than(engine, now - timedelta(days=settings.ingest.retention_days))
    if settings.api.audit_retention_days > 0:
        out["audit"] = prune_audit(engine, now - timedelta(days=settings.api.audit_retention_days))
    return out


AUDIT = table("api_audit_log", column("id"), column("occurred_at", UTCDateTime))
"""The control plane's audit log (:class:`scheduler.api.tables.AuditRow`), named here so the loop's beat job
prunes it without importing the API."""


def prune_audit(engine: Engine, cutoff: datetime, chunk: int = 5000) -> int:
    """Delete audit entries older than ``cutoff`` (in chunks, each its own transaction); returns how many."""
    total = 0
    while True:
        with transaction(engine) as session:
            ids = list(session.scalars(select(AUDIT.c.id).where(AUDIT.c.occurred_at < cutoff).limit(chunk)))
            if not ids:
                return total
            session.execute(delete(AUDIT).where(AUDIT.c.id.in_(ids)))
            total += len(ids)
