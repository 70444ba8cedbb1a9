"""Bearer tokens with roles, and the audit log.

Roles are ordered: ``viewer`` reads, ``operator`` also triggers retrains and deploys. A token is
``ut_`` plus 43 URL-safe characters (256 random bits); only its SHA-256 is stored (see
:mod:`scheduler.api.tables`). Lookups compare hashes through the unique index, so no timing
channel reveals a stored token.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import all_rows, as_utc, revoke_named, transaction
from scheduler.api.tables import ApiTokenRow, AuditRow

Role = Literal["viewer", "operator"]
ROLES: tuple[Role, ...] = ("viewer", "operator")
ROLE_RANK = {"viewer": 1, "operator": 2}
TOKEN_PREFIX = "ut_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name and role."""

    name: str
    role: str
    token_id: int | None = None
    last_used_at: datetime | None = None

    def can(self, role: str) -> bool:
        """True when this principal's role includes ``role``."""
        return ROLE_RANK.get(self.role, 0) >= ROLE_RANK[role]


def generate_token() -> str:
    """A fresh random token (shown once, never stored in clear)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Hex SHA-256 of a token, as stored."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(engine: Engine, name: str, role: str, ttl_days: float | None = None) -> tuple[ApiTokenRow, str]:
    """Store a new token named ``name`` with ``role``, expiring after ``ttl_days`` (None or 0: never); returns
    the row and the clear token."""
    if ttl_days is not None and not 0 <= ttl_days <= 36500:
        raise ValueError("a token's lifetime is 0 (never expires) to 36500 days")
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    if not name or len(name) > 128:
        raise ValueError("a token name must be 1 to 128 characters")
    token = generate_token()
    with transaction(engine) as session:
        if session.scalar(select(ApiTokenRow.id).where(ApiTokenRow.name == name)) is not None:
            raise ValueError(f"a token named {name!r} exists already: pick another name or revoke it first")
        now = datetime.now(UTC)
        row = ApiTokenRow(
            name=name,
            token_hash=hash_token(token),
            prefix=token[:10],
            role=role,
            created_at=now,
            expires_at=now + timedelta(days=ttl_days) if ttl_days else None,
        )
        session.add(row)
    return row, token


def revoke_token(engine: Engine, name: str) -> bool:
    """Revoke the token named ``name``; False when there is none."""
    return revoke_named(engine, ApiTokenRow, name)


def list_tokens(engine: Engine) -> list[ApiTokenRow]:
    """Every token row (hashes only), oldest first."""
    return all_rows(engine, ApiTokenRow)


def resolve_token(session: Session, token: str, now: datetime | None = None) -> Principal | None:
    """The principal a clear token belongs to, or None (unknown, revoked, expired or malformed)."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 128:
        return None
    row = session.scalar(select(ApiTokenRow).where(ApiTokenRow.token_hash == hash_token(token)))
    if row is None or row.revoked_at is not None:
        return None
    if row.expires_at is not None and as_utc(row.expires_at) <= (now or datetime.now(UTC)):
        return None
    return Principal(name=row.name, role=row.role, token_id=row.id, last_used_at=row.last_used_at)


def touch(session: Session, principal: Principal, interval_s: float, now: datetime | None = None) -> bool:
    """Write the token's ``last_used_at`` when the stored one is older than ``interval_s`` (and commit);
    True when it wrote. Throttled so a busy client costs a write per interval, not per request."""
    now = now or datetime.now(UTC)
    last = principal.last_used_at
    if principal.token_id is None or (last is not None and (now - as_utc(last)).total_seconds() < interval_s):
        return False
    session.execute(update(ApiTokenRow).where(ApiTokenRow.id == principal.token_id).values(last_used_at=now))
    session.commit()
    return True


def _text(value: str) -> str:
    return value.replace("\x00", "\ufffd")


def record_audit(
    engine: Engine,
    *,
    actor: str,
    role: str,
    method: str,
    path: str,
    action: str,
    status_code: int,
    client: str | None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Append one entry to the audit log (a NUL, which PostgreSQL text cannot hold, stored as U+FFFD)."""
    actor, method, path, action = (_text(v) for v in (actor, method, path, action))
    with transaction(engine) as session:
        session.add(
            AuditRow(
                occurred_at=datetime.now(UTC),
                actor=actor[:128],
                role=role[:16],
                method=method[:8],
                path=path[:512],
                action=action[:64],
                status_code=status_code,
                client=_text(client or "")[:64] or None,
                detail=detail or {},
            )
        )
