"""API keys of the gateway's client integrations: created, listed and revoked by operators, checked
on every request.

A key is ``ugw_`` plus 43 URL-safe characters (256 random bits), shown once; the database keeps
its SHA-256 (a slow hash guards low-entropy passwords; these are not) and its first characters.
Each key names one client integration and carries:

- ``scopes``: ``serve`` (completions, chat and signals) and/or ``metrics`` (``/gateway/metrics``);
- ``user_id`` (optional): the key speaks for that one user; its requests are served to that user
  and its signals are that user's, whatever the body says;
- ``rate_per_s`` (optional): this client's request rate, in place of the gateway's default.

The gateway reads the keys from the database at most every ``key_refresh_s`` seconds, so a new
or revoked key takes effect within that time; lookups look a presented key up by its hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog
from sqlalchemy import select
from sqlalchemy.engine import Engine

from ingest.db import all_rows, revoke_named, transaction
from serving.tables import GatewayKeyRow

log = structlog.get_logger(__name__)

KEY_PREFIX = "ugw_"
SCOPES = ("serve", "metrics")
MAX_KEY_CHARS = 128


@dataclass(frozen=True)
class ClientKey:
    """Who a presented key belongs to."""

    name: str
    scopes: tuple[str, ...]
    user_id: str | None = None
    rate_per_s: float | None = None


def hash_key(key: str) -> str:
    """Hex SHA-256 of a key, as stored."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def create_key(
    engine: Engine,
    name: str,
    scopes: tuple[str, ...] = ("serve",),
    user_id: str | None = None,
    rate_per_s: float | None = None,
) -> tuple[GatewayKeyRow, str]:
    """Store a new key for the client integration ``name``; returns the row and the clear key."""
    if not name or len(name) > 128:
        raise ValueError("a key name must be 1 to 128 characters")
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}, not {', '.join(unknown) or 'none'}")
    if user_id is not None and not 0 < len(user_id) <= 128:
        raise ValueError("a user id must be 1 to 128 characters")
    if rate_per_s is not None and not rate_per_s > 0:
        raise ValueError("a key's rate must be above 0 requests per second")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with transaction(engine) as session:
        if session.scalar(select(GatewayKeyRow.id).where(GatewayKeyRow.name == name)) is not None:
            raise ValueError(f"a gateway key named {name!r} exists already: pick another name or revoke it first")
        row = GatewayKeyRow(
            name=name,
            key_hash=hash_key(key),
            prefix=key[:10],
            scopes=list(dict.fromkeys(scopes)),
            user_id=user_id,
            rate_per_s=rate_per_s,
            created_at=datetime.now(UTC),
        )
        session.add(row)
    return row, key


def revoke_key(engine: Engine, name: str) -> bool:
    """Revoke the key named ``name``; False when there is none (or it is revoked already)."""
    return revoke_named(engine, GatewayKeyRow, name)


def list_keys(engine: Engine) -> list[GatewayKeyRow]:
    """Every key row (hashes only), oldest first."""
    return all_rows(engine, GatewayKeyRow)


def describe(row: GatewayKeyRow) -> dict[str, object]:
    """A key row as JSON (never its hash)."""
    return {
        "name": row.name,
        "prefix": row.prefix,
        "scopes": list(row.scopes),
        "user_id": row.user_id,
        "rate_per_s": row.rate_per_s,
        "created_at": row.created_at.isoformat(),
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
    }


class KeyRing:
    """The gateway's view of the valid keys: hashes from the database, re-read every ``refresh_s``.

    ``static`` adds keys held outside the database (the ``serving.gateway.metrics_key`` setting the
    loop's deployer uses), as ``{clear key: ClientKey}``.
    """

    def __init__(self, engine: Engine | None, refresh_s: float, static: dict[str, ClientKey] | None = None) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self.static = {hash_key(k): v for k, v in (static or {}).items()}
        self._keys: dict[str, ClientKey] = {}
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    def _load(self) -> dict[str, ClientKey]:
        if self.engine is None:
            return {}
        with transaction(self.engine) as session:
            rows = session.scalars(select(GatewayKeyRow).where(GatewayKeyRow.revoked_at.is_(None)))
            return {r.key_hash: ClientKey(r.name, tuple(r.scopes), r.user_id, r.rate_per_s) for r in rows}

    async def lookup(self, key: str) -> ClientKey | None:
        """The client a presented key belongs to, or None (unknown, revoked or malformed)."""
        if not key or len(key) > MAX_KEY_CHARS:
            return None
        if time.monotonic() - self._at > self.refresh_s:
            async with self._lock:
                if time.monotonic() - self._at > self.refresh_s:
                    try:
                        self._keys = await asyncio.to_thread(self._load)
                    except Exception as exc:  # a database that does not answer: keep the last known keys
                        log.warning("gateway.keys_unavailable", error=f"{exc.__class__.__name__}: {exc}")
                    self._at = time.monotonic()
        digest = hash_key(key)
        return self._keys.get(digest) or self.static.get(digest)
