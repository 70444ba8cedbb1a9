"""Control-plane tables: API tokens (only their SHA-256 is stored) and the audit log of every
mutating call.

Tokens are 256-bit random strings, so a plain SHA-256 is enough to store them safely: a slow
password hash guards low-entropy secrets, and these are not. The first characters (``prefix``)
are kept in clear so an operator can tell tokens apart in listings.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from ingest.db import Base, UTCDateTime


class ApiTokenRow(Base):
    """A bearer token for the API and dashboards, with its role (``viewer`` or ``operator``)."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """Hex SHA-256 of the full token."""
    prefix: Mapped[str] = mapped_column(String(16))
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Last accepted request, written at most once per ``api.token_touch_interval_s``."""
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """When the token stops working (None: never; tokens made before expiry existed)."""


class AuditRow(Base):
    """One mutating call (or login): who, what, when, and how it ended."""

    __tablename__ = "api_audit_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    occurred_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    actor: Mapped[str] = mapped_column(String(128), index=True)
    """Token name (or ``anonymous`` for a failed login)."""
    role: Mapped[str] = mapped_column(String(16))
    method: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(String(512))
    action: Mapped[str] = mapped_column(String(64), index=True)
    status_code: Mapped[int] = mapped_column(Integer)
    client: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
