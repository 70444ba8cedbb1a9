"""Read the other layers' state for the API: one place that knows their tables (reward-model
registry, policy versions and weight-store manifests, fleet and deployments, borrowing, the
reward-hacking guard). Jobs live in :mod:`scheduler.api.queue`.

Routes and dashboards call these functions, never the tables directly, so a change in a
layer's schema touches this module only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import as_utc
from ingest.tables import SessionRow, SignalRow
from policy.tables import PolicyVersionRow
from reward_models.tables import RewardModelRow
from scheduler.api.schemas import PolicyVersion
from scheduler.tables import BorrowEventRow, LeaseRow
from serving.tables import DeploymentRow, ReplicaRow, TargetRow

if TYPE_CHECKING:
    from scheduler.settings import Settings


class Unavailable(RuntimeError):
    """A part of the loop this API reads is not installed or not set up; the message says which."""


# Reward models ---------------------------------------------------------------------------------


def reward_model_versions(
    session: Session, *, status: str | None, limit: int, offset: int
) -> tuple[list[RewardModelRow], int]:
    """Registered reward-model versions, newest first, and how many match."""
    stmt = select(RewardModelRow)
    if status:
        stmt = stmt.where(RewardModelRow.status == status)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(RewardModelRow.created_at.desc()).limit(limit).offset(offset))
    return list(rows), total


def reward_model(session: Session, version: str) -> RewardModelRow | None:
    """One reward-model version, or None."""
    return session.get(RewardModelRow, version)


def reward_model_lineage(session: Session, version: str) -> list[str]:
    """The promoted versions before ``version`` (each replaced the previous), oldest first, then it."""
    row = session.get(RewardModelRow, version)
    if row is None:
        return []
    earlier = session.scalars(
        select(RewardModelRow.version)
        .where(RewardModelRow.created_at < row.created_at, RewardModelRow.promoted_at.is_not(None))
        .order_by(RewardModelRow.created_at)
    )
    return [*earlier, version]


# Fleet and deployments (serving) ----------------------------------------------------------------


def replicas(session: Session, *, pool: str | None, state: str | None) -> list[ReplicaRow]:
    """Registered replicas, by pool then id."""
    stmt = select(ReplicaRow)
    if pool:
        stmt = stmt.where(ReplicaRow.pool == pool)
    if state:
        stmt = stmt.where(ReplicaRow.state == state)
    return list(session.scalars(stmt.order_by(ReplicaRow.pool, ReplicaRow.id)))


def replica_state_counts(session: Session) -> dict[tuple[str, str], int]:
    """Number of replicas per (pool, state)."""
    rows = session.execute(
        select(ReplicaRow.pool, ReplicaRow.state, func.count()).group_by(ReplicaRow.pool, ReplicaRow.state)
    )
    return {(pool, state): n for pool, state, n in rows}


def deployments(
    session: Session, *, pool: str | None, status: str | None, limit: int, offset: int
) -> tuple[list[DeploymentRow], int]:
    """Deployments, newest first, and how many match."""
    stmt = select(DeploymentRow)
    if pool:
        stmt = stmt.where(DeploymentRow.pool == pool)
    if status:
        stmt = stmt.where(DeploymentRow.status == status)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(
        stmt.order_by(DeploymentRow.started_at.desc(), DeploymentRow.id.desc()).limit(limit).offset(offset)
    )
    return list(rows), total


def deployment(session: Session, deployment_id: int) -> DeploymentRow | None:
    """One deployment with its stages, or None."""
    return session.get(DeploymentRow, deployment_id)


def current_deployments(session: Session) -> list[dict[str, Any]]:
    """Per pool: the version it should serve, its replicas' versions, and its latest rollout."""
    pools = set(session.scalars(select(TargetRow.pool))) | set(session.scalars(select(ReplicaRow.pool).distinct()))
    out = []
    for pool in sorted(pools):
        target = session.get(TargetRow, pool)
        latest = session.scalars(
            select(DeploymentRow)
            .where(DeploymentRow.pool == pool)
            .order_by(DeploymentRow.started_at.desc(), DeploymentRow.id.desc())
            .limit(1)
        ).first()
        serving = session.execute(
            select(ReplicaRow.version, func.count()).where(ReplicaRow.pool == pool).group_by(ReplicaRow.version)
        ).all()
        out.append(
            {
                "pool": pool,
                "version": target.version if target else None,
                "weights_hash": target.weights_hash if target else None,
                "replica_versions": {v or "unknown": n for v, n in serving},
                "state": latest.status if latest else "none",
                "latest_deployment_id": latest.id if latest else None,
            }
        )
    return out


class Conflict(RuntimeError):
    """The request contradicts the resource's state (e.g. cancelling a finished job)."""


# Borrowing (scheduler) -------------------------------------------------------------------------

BORROW_STARTS = frozenset({"lent", "lend", "borrowed", "acquired"})
BORROW_ENDS = frozenset({"returned", "released", "expired", "preempted", "reclaimed"})


def borrow_windows(
    session: Session, *, pool: str | None, since: datetime | None, until: datetime | None
) -> list[dict[str, Any]]:
    """Windows in which replicas were lent, oldest first: from the borrow event log, where a window
    opens at a lending event and closes at a return or expiry; a lease still held is an open window."""
    stmt = select(BorrowEventRow).order_by(BorrowEventRow.at, BorrowEventRow.id)
    if pool:
        stmt = stmt.where(BorrowEventRow.pool == pool)
    open_: dict[str, dict[str, Any]] = {}
    windows: list[dict[str, Any]] = []
    for ev in session.scalars(stmt):
        if ev.event in BORROW_STARTS and ev.replica_id not in open_:
            open_[ev.replica_id] = {
                "replica": ev.replica_id,
                "pool": ev.pool,
                "purpose": (ev.detail or {}).get("purpose"),
                "start": ev.at,
                "end": None,
                "info": {"holder": ev.holder},
            }
        elif ev.event in BORROW_ENDS and ev.replica_id in open_:
            window = open_.pop(ev.replica_id)
            window["end"] = ev.at
            window["info"]["ended_by"] = ev.event
            windows.append(window)
    windows.extend(open_.values())
    leases = select(LeaseRow).where(LeaseRow.released_at.is_(None))
    if pool:
        leases = leases.where(LeaseRow.pool == pool)
    for lease in session.scalars(leases):
        if lease.replica_id not in open_:
            windows.append(
                {
                    "replica": lease.replica_id,
                    "pool": lease.pool,
                    "purpose": lease.purpose,
                    "start": lease.acquired_at,
                    "end": None,
                    "info": {"holder": lease.holder, "state": lease.state},
                }
            )
    lo = as_utc(since) if since else None
    hi = as_utc(until) if until else None
    kept = [
        w for w in windows if (lo is None or w["end"] is None or w["end"] >= lo) and (hi is None or w["start"] < hi)
    ]
    return sorted(kept, key=lambda w: (w["start"], w["replica"]))


def _parse_time(value: Any) -> datetime | None:
    try:
        return as_utc(datetime.fromisoformat(value)) if isinstance(value, str) else None
    except ValueError:
        return None


# Policy versions ---------------------------------------------------------------------------------


def _weight_manifests(settings: Settings) -> list[dict[str, Any]]:
    """Manifests of the weight store the settings point at, oldest first.

    The location is resolved by :func:`policy.config.resolve_store_url`; the manifests are
    read as plain JSON at the layout :mod:`policy.weights.store` documents (``versions/<version>/manifest.json``,
    written last), without validating tensor tables, and one that does not parse is skipped.
    """
    import json

    import fsspec

    from policy.config import resolve_store_url

    fs, root = fsspec.core.url_to_fs(resolve_store_url(settings.policy.weights_url, settings.home))
    if not fs.exists(f"{root}/versions"):
        return []
    manifests = []
    for path in fs.glob(f"{root}/versions/*/manifest.json"):
        with fs.open(path, "rb") as handle:
            try:
                data = json.loads(handle.read())
            except ValueError:
                continue
        if isinstance(data, dict) and isinstance(data.get("version"), str):
            manifests.append(data)
    return sorted(manifests, key=lambda m: m.get("seq", 0))


def _all_policy_versions(session: Session, settings: Settings) -> list[PolicyVersion]:
    """Every known policy version, newest first: the trainer's ``policy_versions`` rows (lineage,
    step, data window, staleness, metrics), completed by the weight store's manifests (hash,
    snapshot or delta) and by telemetry (sessions served); a version seen only in telemetry was
    served by weights this deployment did not train."""
    serving = {t.version: t.pool for t in session.scalars(select(TargetRow))}
    out: dict[str, PolicyVersion] = {}

    def status(version: str, default: str) -> str:
        return f"serving ({serving[version]})" if version in serving else default

    for row in session.scalars(select(PolicyVersionRow)):
        out[row.version_id] = PolicyVersion(
            version=row.version_id,
            parent=row.parent_id,
            created_at=row.created_at,
            step=row.step,
            status=status(row.version_id, "trained"),
            info={
                "metrics": dict(row.metrics or {}),
                "data_start": row.data_start.isoformat() if row.data_start else None,
                "data_end": row.data_end.isoformat() if row.data_end else None,
                "num_samples": row.num_samples,
                "num_dropped_stale": row.num_dropped_stale,
                "staleness_mean": row.staleness_mean,
                "staleness_max": row.staleness_max,
            },
        )
    for m in _weight_manifests(settings):
        meta: dict[str, Any] = m["meta"] if isinstance(m.get("meta"), dict) else {}
        version = m["version"]
        stored = {"seq": m.get("seq"), "version_hash": m.get("version_hash"), "has_full": bool(m.get("full"))}
        if version in out:
            out[version].info["weights"] = stored
            continue
        out[version] = PolicyVersion(
            version=version,
            parent=m.get("parent"),
            created_at=_parse_time(m.get("created_at")),
            step=meta.get("step") if isinstance(meta.get("step"), int) else None,
            status=status(version, "stored"),
            info={"weights": stored, "meta": meta},
        )
    seen = session.execute(
        select(SessionRow.policy_version, func.min(SessionRow.occurred_at), func.count()).group_by(
            SessionRow.policy_version
        )
    ).all()
    for version, first, n in seen:
        info = {"sessions": n, "first_served": first.isoformat()}
        if version in out:
            out[version].info.update(info)
        else:
            out[version] = PolicyVersion(
                version=version,
                parent=None,
                created_at=first,
                status=status(version, "seen in telemetry"),
                info=info,
            )
    far_past = datetime.min.replace(tzinfo=UTC)
    return sorted(out.values(), key=lambda p: (p.created_at or far_past, p.version), reverse=True)


def policy_versions(
    session: Session, settings: Settings, *, limit: int, offset: int
) -> tuple[list[PolicyVersion], int]:
    """Policy versions, newest first, and how many there are."""
    versions = _all_policy_versions(session, settings)
    return versions[offset : offset + limit], len(versions)


def policy_version(session: Session, settings: Settings, version: str) -> PolicyVersion | None:
    """One policy version, or None."""
    return next((p for p in _all_policy_versions(session, settings) if p.version == version), None)


def policy_lineage(session: Session, settings: Settings, version: str) -> list[str]:
    """Parents back to the root, oldest first, ending with ``version``."""
    parents = {p.version: p.parent for p in _all_policy_versions(session, settings)}
    chain = [version]
    while parents.get(chain[-1]) and parents[chain[-1]] not in chain:
        chain.append(parents[chain[-1]])  # type: ignore[arg-type]
    return chain[::-1]


# Proxy vs real (reward-hacking guard) ------------------------------------------------------------

_GUARD_CACHE: dict[str, tuple[tuple[Any, ...], float, dict[str, Any]]] = {}


def divergence(session: Session, settings: Settings) -> dict[str, Any]:
    """The reward-hacking guard (:func:`reward_models.api.hacking_check`) on the stored data: per
    policy version the promoted reward model's mean score (proxy) and the mean final retention
    (real), and whether the proxy rose while retention fell. Recomputed only when the promoted
    model changes, or when the counts of sessions and retention reports changed and the last
    verdict is older than ``api.guard_refresh_s`` (scoring every session takes a while)."""
    import time

    from reward_models.registry import current_promoted

    engine = session.get_bind()
    assert isinstance(engine, Engine), "the API's sessions are bound to an engine"
    promoted = current_promoted(engine)
    if promoted is None:
        return {
            "flagged": False,
            "reason": "no reward model has been promoted yet",
            "reward_model": None,
            "versions": [],
        }
    url = str(engine.url)
    key = (
        promoted.version,
        session.scalar(select(func.count()).select_from(SessionRow)),
        session.scalar(select(func.count()).where(SignalRow.type == "code.retained")),
    )
    cached = _GUARD_CACHE.get(url)
    fresh = cached is not None and (
        cached[0] == key or (cached[0][0] == key[0] and time.monotonic() - cached[1] < settings.api.guard_refresh_s)
    )
    if not fresh:
        from reward_models.api import hacking_check
        from reward_models.registry import CorruptArtifact

        try:
            report = hacking_check(engine, settings.rewards, version=promoted.version)
        except CorruptArtifact as exc:  # say so on the dashboard instead of failing the page
            return {"flagged": False, "reason": str(exc), "reward_model": promoted.version, "versions": []}
        last = report.versions[-1]["policy_version"] if report.versions else None
        _GUARD_CACHE[url] = (
            key,
            time.monotonic(),
            {
                "flagged": report.flagged,
                "reason": report.reason,
                "reward_model": promoted.version,
                "proxy_rise": report.proxy_rise,
                "real_drop": report.real_drop,
                "versions": [
                    {
                        "policy_version": v["policy_version"],
                        "proxy": v["proxy"],
                        "real": v["real"],
                        "n": v["sessions"],
                        "flagged": report.flagged and v["policy_version"] == last,
                    }
                    for v in report.versions
                ],
            },
        )
    return _GUARD_CACHE[url][2]
