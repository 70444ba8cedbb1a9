"""Pydantic schemas of the API (request bodies and responses), kept apart from the tables.

Every schema carries an example so the OpenAPI document at ``/api/v1/openapi.json`` shows what
a call looks like.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ingest.db import as_utc

EXAMPLE_TS = "2026-11-29T03:00:00Z"
T = TypeVar("T")


UtcDateTime = Annotated[datetime, AfterValidator(as_utc)]
"""A timestamp normalized to UTC (naive means UTC; one that UTC cannot represent is a 422, not a crash)."""

NAME_PATTERN = r"^[^\x00-\x1f\x7f]+$"
"""Identifiers and names: any printable text (no control characters, which PostgreSQL refuses)."""


class Health(BaseModel):
    """Liveness and database reachability."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok", "database": "ok", "version": "0.1.0"}]})

    status: Literal["ok", "degraded"]
    database: str
    version: str


class Page(BaseModel, Generic[T]):
    """A page of items, newest first, with the total count before paging."""

    items: list[T]
    total: int
    limit: int
    offset: int


class RetrainRequest(BaseModel):
    """What to retrain, on which window of telemetry."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"kind": "reward_model", "window_hours": 168},
                {"kind": "rl_run", "since": "2026-11-28T00:00:00Z", "until": EXAMPLE_TS, "reason": "nightly"},
            ]
        },
    )

    kind: Literal["reward_model", "rl_run"] = Field(
        description="`reward_model` retrains the reward models; `rl_run` runs an RL update."
    )
    since: UtcDateTime | None = Field(None, description="Start of the telemetry window (inclusive).")
    until: UtcDateTime | None = Field(None, description="End of the telemetry window (exclusive); default: now.")
    window_hours: float | None = Field(
        None, gt=0, le=24 * 365, description="Window length ending at `until`, instead of `since`."
    )
    force: bool = Field(
        False, description="Retrain even when the triggers see no reason to (a reward-model retrain only)."
    )
    reason: str = Field("", max_length=500, description="Free text recorded with the job and the audit entry.")


class Job(BaseModel):
    """One scheduled unit of work and where it stands."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "job-7f3a",
                    "kind": "reward_model_retrain",
                    "state": "queued",
                    "created_at": EXAMPLE_TS,
                    "started_at": None,
                    "finished_at": None,
                    "params": {"since": "2026-11-22T03:00:00Z", "until": EXAMPLE_TS},
                    "result": {},
                    "error": None,
                }
            ]
        }
    )

    id: str
    kind: str
    state: str
    created_at: UtcDateTime
    started_at: UtcDateTime | None = None
    finished_at: UtcDateTime | None = None
    params: dict[str, Any] = {}
    """The state the job started with (:class:`scheduler.loop.state.LoopState`)."""
    result: dict[str, Any] = {}
    """The state its last step handed back (each step's outcome filled in)."""
    error: str | None = None
    steps: list[dict[str, Any]] = []
    """Each step: ``name``, ``state``, ``attempts``, ``error``."""


class RewardModelVersion(BaseModel):
    """A registered reward-model version."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "version": "rm-20261129-0300",
                    "created_at": EXAMPLE_TS,
                    "backend": "sklearn",
                    "status": "promoted",
                    "reason": "beats rm-20261128 on the same hold-out (AUC 0.81 vs 0.78)",
                    "window_start": "2026-11-22T03:00:00Z",
                    "window_end": EXAMPLE_TS,
                    "n_labeled": 5120,
                    "primary_metric": 0.81,
                    "promoted_at": EXAMPLE_TS,
                }
            ]
        }
    )

    version: str
    created_at: UtcDateTime
    backend: str
    status: str
    reason: str
    window_start: UtcDateTime | None
    window_end: UtcDateTime | None
    n_labeled: int
    primary_metric: float | None
    promoted_at: UtcDateTime | None


class PolicyVersion(BaseModel):
    """A trained policy version."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "version": "v3",
                    "parent": "v2",
                    "created_at": EXAMPLE_TS,
                    "step": 30,
                    "status": "deployed",
                    "info": {},
                }
            ]
        }
    )

    version: str
    parent: str | None
    created_at: UtcDateTime | None
    step: int | None = None
    status: str | None = None
    info: dict[str, Any] = {}


class Metrics(BaseModel):
    """Metrics of one version (held-out metrics, training metrics, online reward summary)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"version": "v3", "metrics": {"retention/auc": 0.81}}]})

    version: str
    metrics: dict[str, Any]


class Lineage(BaseModel):
    """The chain of versions a version descends from, oldest first, ending with itself."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"version": "v3", "chain": ["v0", "v1", "v2", "v3"]}]})

    version: str
    chain: list[str]


class RewardPoint(BaseModel):
    """Mean of a signal in one time bucket for one policy version, with its 95% CI."""

    policy_version: str
    bucket_start: UtcDateTime
    mean: float | None
    n: int
    ci_low: float | None
    ci_high: float | None


class RewardSeries(BaseModel):
    """A reward time series per policy version."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "signal": "retention",
                    "horizon_s": 86400,
                    "bucket_s": 3600,
                    "points": [
                        {
                            "policy_version": "v2",
                            "bucket_start": EXAMPLE_TS,
                            "mean": 0.62,
                            "n": 140,
                            "ci_low": 0.57,
                            "ci_high": 0.67,
                        }
                    ],
                }
            ]
        }
    )

    signal: str
    horizon_s: int | None
    bucket_s: int
    points: list[RewardPoint]


class SignalSummary(BaseModel):
    """Mean of one signal (retention: one horizon) for one policy version over the window."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "policy_version": "v2",
                    "signal": "acceptance",
                    "horizon_s": None,
                    "mean": 0.71,
                    "n": 800,
                    "ci_low": 0.68,
                    "ci_high": 0.74,
                }
            ]
        }
    )

    policy_version: str
    signal: str
    horizon_s: int | None
    mean: float | None
    n: int
    ci_low: float | None
    ci_high: float | None


class Divergence(BaseModel):
    """Proxy reward against the real outcome for one policy version, and the guard's verdict."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"policy_version": "v4", "proxy": 0.74, "real": 0.41, "n": 300, "flagged": True}]
        }
    )

    policy_version: str
    proxy: float | None
    real: float | None
    n: int
    flagged: bool


class GuardReport(BaseModel):
    """The reward-hacking guard's verdict over the stored data, and the per-version means it read."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "flagged": True,
                    "reason": "proxy reward rose +0.410 while retention fell 0.210 from v2 to v4",
                    "reward_model": "rm-0003-1a2b3c4d",
                    "proxy_rise": 0.41,
                    "real_drop": 0.21,
                    "versions": [
                        {"policy_version": "v2", "proxy": 0.33, "real": 0.62, "n": 300, "flagged": False},
                        {"policy_version": "v4", "proxy": 0.74, "real": 0.41, "n": 280, "flagged": True},
                    ],
                }
            ]
        }
    )

    flagged: bool
    reason: str
    reward_model: str | None
    proxy_rise: float | None = None
    real_drop: float | None = None
    versions: list[Divergence]


class SessionInfo(BaseModel):
    """A served session. ``prompt`` and ``completion`` are present only for callers allowed to read code."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "session_id": "s-01",
                    "occurred_at": EXAMPLE_TS,
                    "model": "undertow-coder",
                    "policy_version": "v2",
                    "group_id": None,
                    "num_completion_tokens": 57,
                    "prompt": None,
                    "completion": None,
                    "text_redacted": True,
                }
            ]
        }
    )

    session_id: str
    occurred_at: UtcDateTime
    model: str
    policy_version: str
    group_id: str | None
    num_completion_tokens: int
    prompt: str | None = None
    completion: str | None = None
    text_redacted: bool


class AuditEntry(BaseModel):
    """One audited call."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "occurred_at": EXAMPLE_TS,
                    "actor": "ops-alice",
                    "role": "operator",
                    "method": "POST",
                    "path": "/api/v1/retrains",
                    "action": "retrain.create",
                    "status_code": 202,
                    "client": "10.0.0.7",
                    "detail": {"job_id": "job-7f3a"},
                }
            ]
        }
    )

    occurred_at: UtcDateTime
    actor: str
    role: str
    method: str
    path: str
    action: str
    status_code: int
    client: str | None
    detail: dict[str, Any]


class Replica(BaseModel):
    """One engine replica in the fleet registry."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "cpu-0",
                    "url": "http://127.0.0.1:8301",
                    "pool": "default",
                    "region": "local",
                    "backend": "cpu",
                    "state": "serving",
                    "version": "v2",
                    "health": "ok",
                    "last_check": EXAMPLE_TS,
                }
            ]
        }
    )

    id: str
    url: str
    pool: str
    region: str
    backend: str
    state: str
    version: str | None
    health: str
    last_check: UtcDateTime | None


class StateCount(BaseModel):
    """How many replicas of a pool are in a state."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"pool": "default", "state": "borrowed", "replicas": 1}]})

    pool: str
    state: str
    replicas: int


class BorrowWindow(BaseModel):
    """A replica lent to training (or rollout generation) and when it came back."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "replica": "cpu-2",
                    "pool": "default",
                    "purpose": "training",
                    "start": "2026-11-29T01:00:00Z",
                    "end": EXAMPLE_TS,
                }
            ]
        }
    )

    replica: str
    pool: str
    purpose: str | None = None
    start: UtcDateTime
    end: UtcDateTime | None
    info: dict[str, Any] = {}


class PoolStatus(BaseModel):
    """What a pool serves now and where its latest rollout stands."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "pool": "default",
                    "version": "v3",
                    "weights_hash": "9c1e...",
                    "replica_versions": {"v3": 3},
                    "state": "succeeded",
                    "latest_deployment_id": 4,
                }
            ]
        }
    )

    pool: str
    version: str | None
    weights_hash: str | None
    replica_versions: dict[str, int]
    state: str
    latest_deployment_id: int | None


class DeploymentStage(BaseModel):
    """One stage of a rollout (canary, progressive steps) and its gate outcome."""

    idx: int
    name: str
    replicas: list[str]
    outcome: str
    metrics: dict[str, Any]
    started_at: UtcDateTime
    finished_at: UtcDateTime | None


class Deployment(BaseModel):
    """A rollout of a version over a pool."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": 4,
                    "pool": "default",
                    "from_version": "v2",
                    "to_version": "v3",
                    "kind": "delta",
                    "status": "succeeded",
                    "message": "",
                    "started_at": EXAMPLE_TS,
                    "finished_at": EXAMPLE_TS,
                    "stages": [],
                }
            ]
        }
    )

    id: int
    pool: str
    from_version: str
    to_version: str
    kind: str
    status: str
    message: str
    started_at: UtcDateTime
    finished_at: UtcDateTime | None
    stages: list[DeploymentStage] = []


class RolloutRequest(BaseModel):
    """Start rolling a policy version out to a pool (canary first, then progressive)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"version": "v3", "pool": "default"}]})

    version: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN, description="Policy version to deploy.")
    pool: str = Field("default", min_length=1, max_length=64, pattern=NAME_PATTERN, description="Pool to deploy to.")
    reason: str = Field("", max_length=500, description="Free text recorded with the job and the audit entry.")


class ActionRequest(BaseModel):
    """Optional reason for promote, roll back or cancel."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"reason": "canary looks good"}]})

    reason: str = Field("", max_length=500, description="Free text recorded with the job and the audit entry.")


class PromoteRequest(ActionRequest):
    """Optional reason for a promotion, and ``force`` to override the reward-hacking guard (audited)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"reason": "canary looks good"}, {"reason": "x", "force": True}]},
    )

    force: bool = Field(
        False,
        description="Promote even when the reward-hacking guard flags the version (recorded in the audit entry).",
    )
