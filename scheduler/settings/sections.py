"""Configuration sections owned by the scheduler layer."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator


class PoolConfig(BaseModel):
    """One serving pool (a cluster in one region) whose replicas the scheduler may borrow."""

    name: str = "default"
    """Pool name (unique)."""
    region: str = "local"
    """Region the pool runs in (shown in reports)."""
    replicas: int = Field(default=32, ge=1)
    """Serving replicas in the pool."""
    utc_offset_h: float = Field(default=0.0, ge=-12, le=14)
    """Local time of the pool's users minus the trace's clock, in hours (its daily phase)."""
    gpus_per_replica: int = Field(default=1, ge=1)
    """GPUs behind one replica (GPU-hours = replica-hours times this)."""


class SchedulerConfig(BaseModel):
    """Celery, capacity planning and borrowing."""

    celery_broker_url: str | None = None
    """Celery broker; default: the SQLAlchemy transport on the Undertow database."""
    celery_result_backend: str | None = None
    """Celery result backend; default: the database result backend on the Undertow database."""
    task_max_retries: int = Field(default=3, ge=0)
    """Retries of a task that failed with a transient error."""
    task_retry_backoff_s: float = Field(default=2.0, gt=0)
    """First retry delay; doubles on each retry (with jitter)."""
    planning_interval_s: float = Field(default=600.0, gt=0)
    """How often celery beat runs the capacity plan and the lease reaper."""
    retrain_check_interval_s: float = Field(default=900.0, gt=0)
    """How often celery beat asks the reward-model retrain triggers (new labels, age, score drift) and starts a
    reward-model retrain job when one holds."""
    window_s: int = Field(default=600, ge=60)
    """Planning window: demand is forecast and replicas are lent per window."""
    burst_interval_s: int = Field(default=10, ge=1)
    """Sub-window interval over which serving capacity must cover the arrival rate."""
    default_cv: float = Field(default=1.0, gt=0)
    """Inter-arrival coefficient of variation assumed where a trace gives none (1: Poisson)."""
    forecast_history_days: int = Field(default=7, ge=1)
    """Past days the seasonal demand profile is built from."""
    forecast_trend_windows: int = Field(default=6, ge=1)
    """Recent windows the level (trend) correction is measured over."""
    forecast_quantile: float = Field(default=0.8, gt=0.5, lt=1)
    """Upper quantile of the forecast's own past errors added on top of the point forecast."""
    burst_reserve_quantile: float = Field(default=0.999, gt=0.5, lt=1)
    """Error quantile of the tail forecast that sizes the hot reserve of generation replicas."""
    max_generation_share: float = Field(default=0.6, ge=0, le=1)
    """Most of the borrowed replicas that may generate (the hot reserve) instead of training."""
    headroom: float = Field(default=0.05, ge=0)
    """Capacity kept above the forecast demand, as a fraction of it."""
    latency_slo_s: float = Field(default=2.0, gt=0)
    """p99 latency target; a replica's capacity is the load it serves within it."""
    min_serving_replicas: int = Field(default=1, ge=0)
    """Replicas of a pool that are never lent."""
    drain_s: float = Field(default=20.0, ge=0)
    """Seconds to drain a replica in the gateway (in-flight requests finish)."""
    sleep_s: float = Field(default=5.0, ge=0)
    """Seconds to put a drained replica to sleep (vLLM sleep level 1) and hand it over."""
    checkpoint_s: float = Field(default=15.0, ge=0)
    """Seconds a training job needs to checkpoint and yield a borrowed replica."""
    wake_s: float = Field(default=20.0, ge=0)
    """Seconds to wake a replica (reload weights, rebuild the KV cache)."""
    verify_s: float = Field(default=5.0, ge=0)
    """Seconds to verify the served weights version and rejoin the gateway."""
    generation_return_s: float = Field(default=2.0, ge=0)
    """Seconds to abort a generation replica's rollouts and put it back in rotation (it stays awake)."""
    train_step_s: float = Field(default=10.0, ge=0)
    """Longest training step: a recalled training job yields at the next step boundary."""
    preempt_deadline_s: float = Field(default=60.0, gt=0)
    """A recalled replica must be serving again within this many seconds."""
    preempt_trigger_utilization: float = Field(default=0.9, gt=0, le=1)
    """Recall borrowed replicas once demand exceeds this fraction of the serving capacity."""
    lease_ttl_s: float = Field(default=120.0, gt=0)
    """A borrowed replica's lease expires unless its holder renews it within this."""
    generation_cost_per_token: float = Field(default=1.5, gt=0)
    """Measured cost of generating one rollout token, in forward-pass time (memory-bound decoding: 1.5)."""
    training_cost_per_token: float = Field(default=3.0, gt=0)
    """Cost of training one token in forward passes (forward + backward = 3): a third of borrowed time generates."""
    fixed_window_start_h: float = Field(default=1.0, ge=0, lt=24)
    """Baseline: local hour the fixed nightly borrowing window opens."""
    fixed_window_end_h: float = Field(default=6.0, gt=0, le=24)
    """Baseline: local hour the fixed nightly borrowing window closes."""
    pools: list[PoolConfig] = Field(default_factory=lambda: [PoolConfig()])
    """Serving pools the scheduler may borrow from."""
    fleet_control: str = "scheduler.loop.borrowing:registry_fleet"
    """Override point: ``module:function`` building the fleet control (drain, sleep, wake, verify, rejoin)
    from the settings, for a fleet the serving registry does not manage (a cluster manager's own API)."""
    rl_trainer: str = "scheduler.loop.training:production_trainer"
    """Override point: ``module:function`` building the preemptible RL trainer session from the settings and
    the job's :class:`scheduler.loop.state.LoopState`, for an operator's own trainer."""
    job_heartbeat_s: float = Field(default=10.0, gt=0)
    """How often a running step records that its worker is alive."""
    job_lost_after_s: float = Field(default=60.0, gt=0)
    """A running step silent this long is marked LOST (its worker was killed or cut off)."""
    longest_step_s: float = Field(default=4 * 3600.0, gt=0)
    """Longest a step may run (a training step's run between two preemptions); the Redis visibility
    timeout is set from it, so a running step's message is never handed to a second worker."""
    checkpoint_dir: str = "checkpoints"
    """Directory under the Undertow home where preempted training jobs checkpoint."""
    checkpoint_every_steps: int = Field(default=10, ge=1)
    """Training steps between two periodic checkpoints (what a killed worker can lose at most)."""
    preempt_resume_s: float = Field(default=30.0, ge=0)
    """Delay before a preempted training job is retried (it resumes from its checkpoint)."""
    training_replicas: int = Field(default=1, ge=1)
    """Most replicas one RL update borrows."""
    clock_speedup: float = Field(default=1.0, gt=0)
    """Simulated seconds per wall second of the fleet's clock (1 in production; the demo replays a day in minutes)."""


class ApiConfig(BaseModel):
    """The FastAPI control plane and its dashboards."""

    host: str = "127.0.0.1"
    """Interface the control plane binds to (``0.0.0.0`` to expose it beyond this machine)."""
    port: int = 8200
    """Port the control plane listens on."""
    max_body_bytes: int = 64 * 1024
    """Largest request body accepted; bigger requests get 413."""
    rate_limit_per_minute: int = 600
    """Sustained requests per minute allowed per valid token; requests without one (or with an unknown, revoked
    or expired one) share their client address's bucket of the same size."""
    rate_limit_burst: int = 120
    """Requests a client may send at once before the per-minute rate applies."""
    trusted_proxies: list[str] = Field(default_factory=list)
    """Addresses or networks (CIDR) of the reverse proxies in front of the API: only from these is
    ``X-Forwarded-For`` honoured (its rightmost untrusted address is the client, for rate limits and the
    audit log); empty: the connecting address is the client."""
    token_ttl_days: float = Field(default=90.0, ge=0)
    """Lifetime of a new API token (``undertow tokens create --expires-days`` overrides it); 0: never expires."""
    token_touch_interval_s: float = Field(default=300.0, ge=0)
    """A token's ``last_used_at`` is written at most this often (not on every request)."""
    audit_retention_days: int = Field(default=365, ge=0)
    """Audit entries older than this many days are deleted by the ``undertow.enforce_retention`` beat job; 0 keeps
    them."""
    expose_text_to_viewers: bool = False
    """Let viewer tokens read prompts and generated code; off: only operators see them."""
    metrics_require_token: bool = False
    """Require a bearer token on ``/metrics`` (Prometheus can send one); off: open like ``/health``."""
    cookie_secure: bool = False
    """Mark the dashboard login cookie ``Secure`` (turn on behind HTTPS)."""
    session_max_age_s: int = 12 * 3600
    """How long a dashboard login lasts before the browser must log in again."""
    guard_refresh_s: float = 60.0
    """Longest a reward-hacking verdict is reused while new data arrives (it scores every session)."""

    @field_validator("trusted_proxies")
    @classmethod
    def _valid_proxies(cls, value: list[str]) -> list[str]:
        import ipaddress

        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(f"trusted proxy {item!r} is not an IP address or network (CIDR)") from exc
        return value
