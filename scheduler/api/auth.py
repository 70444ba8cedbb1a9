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
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ingest.db import all_rows, revoke_named, transaction
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

    def can(self, role: str) -> bool:
        """True when this principal's role includes ``role``."""
        return ROLE_RANK.get(self.role, 0) >= ROLE_RANK[role]


def generate_token() -> str:
    """A fresh random token (shown once, never stored in clear)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Hex SHA-256 of a token, as stored."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(engine: Engine, name: str, role: str) -> tuple[ApiTokenRow, str]:
    """Store a new token named ``name`` with ``role``; returns the row and the clear token."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    if not name or len(name) > 128:
        raise ValueError("a token name must be 1 to 128 characters")
    token = generate_token()
    with transaction(engine) as session:
        if session.scalar(select(ApiTokenRow.id).where(ApiTokenRow.name == name)) is not None:
            raise ValueError(f"a token named {name!r} exists already: pick another name or revoke it first")
        row = ApiTokenRow(
            name=name,
            token_hash=hash_token(token),
            prefix=token[:10],
            role=role,
            created_at=datetime.now(UTC),
        )
        session.add(row)
    return row, token


def revoke_token(engine: Engine, name: str) -> bool:
    """Revoke the token named ``name``; False when there is none."""
    return revoke_named(engine, ApiTokenRow, name)


def list_tokens(engine: Engine) -> list[ApiTokenRow]:
    """Every token row (hashes only), oldest first."""
    return all_rows(engine, ApiTokenRow)


def resolve_token(session: Session, token: str) -> Principal | None:
    """The principal a clear token belongs to, or None (unknown, revoked or malformed)."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 128:
        return None
    row = session.scalar(select(ApiTokenRow).where(ApiTokenRow.token_hash == hash_token(token)))
    if row is None or row.revoked_at is not None:
        return None
    return Principal(name=row.name, role=row.role)


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
    """Append one entry to the audit log."""
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
                client=(client or "")[:64] or None,
                detail=detail or {},
            )
        )
