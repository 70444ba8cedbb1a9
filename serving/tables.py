"""Serving tables: the fleet registry (replicas), the version each pool should serve, and
deployments with their stages and outcomes.

A replica is *in rotation* when its state is ``serving`` and its last health check was ``ok``
(reachable, serving the pool's target version with the expected hash). ``health`` says why a
replica is out: ``unreachable``, ``hash_mismatch`` (its weights do not match the version it
claims) or ``behind`` (it serves another version than the pool's target; reconcile brings it back).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from ingest.db import Base, UTCDateTime

REPLICA_STATES = ("serving", "draining", "borrowed", "sleeping", "updating")
HEALTH = ("unknown", "ok", "unreachable", "hash_mismatch", "behind")


class ReplicaRow(Base):
    """One engine replica (a ``vllm serve`` or CPU engine process) behind the gateway."""

    __tablename__ = "serving_replicas"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str] = mapped_column(String(512), unique=True)
    pool: Mapped[str] = mapped_column(String(64), default="default", index=True)
    region: Mapped[str] = mapped_column(String(64), default="local")
    backend: Mapped[str] = mapped_column(String(16), default="cpu")
    """``cpu`` (the reference engine) or ``vllm``."""
    state: Mapped[str] = mapped_column(String(16), default="serving", index=True)
    """One of :data:`REPLICA_STATES`."""
    version: Mapped[str | None] = mapped_column(String(128))
    """Weights version the replica reported at its last check."""
    weights_hash: Mapped[str | None] = mapped_column(String(128))
    """Weights hash the replica reported at its last check."""
    health: Mapped[str] = mapped_column(String(32), default="unknown")
    """One of :data:`HEALTH`."""
    failures: Mapped[int] = mapped_column(Integer, default=0)
    """Consecutive failed health checks."""
    last_check: Mapped[datetime | None] = mapped_column(UTCDateTime)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime)


class TargetRow(Base):
    """The version (and its hash) a pool should serve; moved by deployments and rollbacks."""

    __tablename__ = "serving_targets"

    pool: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(128))
    weights_hash: Mapped[str] = mapped_column(String(128))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class DeploymentRow(Base):
    """One rollout of ``to_version`` over a pool."""

    __tablename__ = "serving_deployments"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    pool: Mapped[str] = mapped_column(String(64), index=True)
    from_version: Mapped[str] = mapped_column(String(128))
    to_version: Mapped[str] = mapped_column(String(128))
    to_hash: Mapped[str] = mapped_column(String(128))
    from_hash: Mapped[str | None] = mapped_column(String(128))
    """Hash of ``from_version`` (what a rollback restores)."""
    kind: Mapped[str] = mapped_column(String(16))
    """``delta`` or ``snapshot`` (how replicas pull the new weights)."""
    status: Mapped[str] = mapped_column(String(16), index=True)
    """``running``, ``succeeded``, ``rolled_back`` or ``failed`` (also: a deployer that stopped beating)."""
    message: Mapped[str] = mapped_column(Text, default="")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Last sign of life of the deployer; a running deployment without one for a while is stale."""
    requested: Mapped[str | None] = mapped_column(String(16))
    """What an operator asked of it while running (``promote`` or ``rollback``; :mod:`serving.actions`)."""

    stages: Mapped[list[DeploymentStageRow]] = relationship(
        back_populates="deployment", order_by="DeploymentStageRow.idx", cascade="all, delete-orphan"
    )


class DeploymentStageRow(Base):
    """One stage of a deployment (canary, then progressive steps) and its gate outcome."""

    __tablename__ = "serving_deployment_stages"

    deployment_id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"),
        ForeignKey("serving_deployments.id", ondelete="CASCADE"),
        primary_key=True,
    )
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(32))
    replicas: Mapped[list[str]] = mapped_column(JSON, default=list)
    outcome: Mapped[str] = mapped_column(String(16))
    """``running``, ``passed``, ``failed`` (gate) or ``error`` (an update failed)."""
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Gate inputs: per-version request counts, error rates, latencies, acceptance."""
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    deployment: Mapped[DeploymentRow] = relationship(back_populates="stages")


class GatewayKeyRow(Base):
    """An API key of one client integration of the gateway (only its SHA-256 is stored)."""

    __tablename__ = "gateway_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    """The client integration (an editor plugin, an agent runner)."""
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """Hex SHA-256 of the full key."""
    prefix: Mapped[str] = mapped_column(String(16))
    scopes: Mapped[list[str]] = mapped_column(JSON, default=list)
    """``serve`` (completions and signals) and/or ``metrics`` (``/gateway/metrics``)."""
    user_id: Mapped[str | None] = mapped_column(String(128))
    """When set, the key speaks for this one user only: its requests and signals are that user's."""
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    """Requests plus signals per second this client may send (default: the gateway's ``client_rate_per_s``)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
