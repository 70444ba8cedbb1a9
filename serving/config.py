"""Configuration sections owned by the serving layer: engines, gateway, fleet health and deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr


class EngineConfig(BaseModel):
    """The CPU reference engine (``undertow engine serve``)."""

    host: str = "127.0.0.1"
    """Interface the engine listens on."""
    port: int = 8200
    """Port the engine listens on."""
    served_model_name: str = "undertow-policy"
    """Model name reported by ``/v1/models`` and accepted in requests."""
    enable_return_routed_experts: bool = True
    """Attach ``routed_experts`` to every choice (vLLM's ``--enable-return-routed-experts``)."""
    max_model_len: int = Field(default=2048, ge=8)
    """Longest prompt plus completion, in tokens."""
    max_tokens_limit: int = Field(default=512, ge=1)
    """Largest ``max_tokens`` a request may ask for."""
    max_n: int = Field(default=16, ge=1)
    """Largest ``n`` (parallel samples) a request may ask for."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the engine process."""
    reserve_update_memory: bool = True
    """At start, keep freed memory for reuse and pre-touch a snapshot's worth of staging memory on the
    weight-update thread, so no update (the first included) faults its staging pages in (glibc only;
    resident memory stays at its peak, see ``serving.memory``)."""


class GatewayConfig(BaseModel):
    """The user-facing gateway (``undertow gateway``)."""

    host: str = "127.0.0.1"
    """Interface the gateway listens on."""
    max_body_bytes: int = Field(default=256 * 1024, ge=1024)
    """Requests with a larger body are refused with 413."""
    max_prompt_chars: int = Field(default=32_000, ge=1)
    """Longest prompt text accepted (422 beyond)."""
    max_candidates: int = Field(default=8, ge=1)
    """Largest K for a candidate group."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """How long the gateway waits for an engine before answering 504."""
    retries: int = Field(default=2, ge=0)
    """Other replicas tried when one fails to answer (connection errors, 5xx)."""
    fleet_refresh_s: float = Field(default=1.0, gt=0)
    """How often the gateway reloads the set of replicas in rotation from the registry."""
    spool_dir: str = "gateway-spool"
    """Directory (under the Undertow home) of telemetry buffered while Kafka is unreachable."""
    spool_max_bytes: int = Field(default=8 * 1024 * 1024 * 1024, ge=1024)
    """Ceiling of the on-disk telemetry buffer whatever ``spool_hours`` asks for (see ``docs/telemetry.md``,
    "When Kafka is down"): at the cap new completions get 503 and signals are shed, counted by type."""
    spool_hours: float | None = Field(default=1.0, gt=0)
    """Hours of Kafka outage the spool holds: the cap is this many hours of telemetry at
    ``spool_events_per_s`` (else the busiest minute of the last hour) times the mean event size, within
    ``spool_max_bytes`` and the disk's free space; None: ``spool_max_bytes``."""
    spool_events_per_s: float | None = Field(default=None, gt=0)
    """Telemetry events per second to size the spool for (peak); None: measured."""
    spool_min_free_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)
    """Disk space the spool always leaves free for the rest of the host."""
    spool_signal_share: float = Field(default=0.8, gt=0, le=1)
    """Signals are shed (503 to the client, counted) once the spool holds more than this share of its cap;
    the rest is kept for ``session.completed``."""
    spool_full_policy: Literal["backpressure", "drop"] = "backpressure"
    """At the cap: ``backpressure`` refuses new completions with 503 and ``Retry-After`` (no session is
    lost); ``drop`` keeps serving and drops their ``session.completed`` events (counted, logged)."""
    backpressure_retry_after_s: float = Field(default=5.0, gt=0)
    """``Retry-After`` of a 503 sent because the telemetry spool is full."""
    emit_queue_size: int = Field(default=10_000, ge=1)
    """Events held in memory between a request and the telemetry router thread, which moves them to Kafka or
    to disk as they come; while it is full, signals and new completions get 503."""
    signal_max_skew_s: float = Field(default=300.0, ge=0)
    """A signal whose ``occurred_at`` is later than the gateway's clock plus this is refused (422)."""
    require_keys: bool = True
    """Clients must present an API key (``undertow gateway-keys create``); off only on a closed test bench."""
    key_refresh_s: float = Field(default=5.0, gt=0)
    """How often the gateway re-reads its keys: a created or revoked key takes effect within this."""
    metrics_key: SecretStr | None = None
    """A key, held in the settings, that may read ``/gateway/metrics`` (the loop's deployer sends it); keys in
    the database with the ``metrics`` scope may too."""
    signing_key_id: str = "gateway"
    """The id, among ``ingest.signing_keys``, of the key the gateway signs its telemetry with (unsigned when
    absent)."""
    client_rate_per_s: float = Field(default=200.0, gt=0)
    """Requests plus signals per second one client key may send (a key's own ``rate_per_s`` overrides it)."""
    client_burst: float = Field(default=400.0, ge=1)
    """Requests a client may send at once before its rate applies."""
    user_rate_per_s: float = Field(default=2.0, gt=0)
    """Completions per second one user may ask for."""
    user_burst: float = Field(default=30.0, ge=1)
    """Completions a user may ask for at once before their rate applies."""
    user_signal_rate_per_s: float = Field(default=1.0, gt=0)
    """Signals per second one user may send."""
    user_signal_burst: float = Field(default=60.0, ge=1)
    """Signals a user may send at once before their rate applies."""
    gate_signals_per_user: int = Field(default=3, ge=0)
    """In the acceptance the deployment gate reads, one user's signals count at most this many times per
    version (a mean of per-user means, weighted by ``min(signals, this)``); 0 counts every signal."""
    gate_trim_users: float = Field(default=0.05, ge=0, lt=0.5)
    """Share of users with the highest, and the same with the lowest, acceptance left out of the gate's mean
    (at least one each from five judged users on): a user alone at an extreme cannot move it."""


class FleetConfig(BaseModel):
    """The fleet registry and its health checks."""

    health_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between two health checks of every replica."""
    health_timeout_s: float = Field(default=2.0, gt=0)
    """A replica that does not answer within this is unreachable."""
    unhealthy_after: int = Field(default=2, ge=1)
    """Consecutive failed checks before a replica leaves rotation."""
    control_token: SecretStr | None = None
    """The bearer token every engine requires on its control routes (pause, sleep, ``collective_rpc``: all
    but inference); the health checks, the deployer and borrowing send it. The CPU engine reads it here,
    vLLM (``--middleware serving.engine_auth.ControlAuth``) from ``UNDERTOW_SERVING__FLEET__CONTROL_TOKEN``.
    Unset: engines refuse every control call."""


class DeployConfig(BaseModel):
    """Delta deployment: canary, progressive stages, the gate and rollback."""

    canary_replicas: int = Field(default=1, ge=1)
    """Replicas updated in the canary stage."""
    stages: list[float] = Field(default_factory=lambda: [0.5, 1.0])
    """Fractions of the fleet on the new version after each stage that follows the canary."""
    gate_min_requests: int = Field(default=20, ge=1)
    """Requests the new version must have served before a stage is judged."""
    gate_min_judged: int = Field(default=0, ge=0)
    """Judged sessions (signals of the acceptance proxy) the new version must have before a stage is
    judged, when the metrics source counts them (``judged``): users signal on few sessions, and late,
    so a version served to enough requests may have been judged by nobody yet; not reaching it by the
    deadline fails the gate (a version nobody could judge is not promoted). 0 (default, for fleets
    whose users send no signals): requests alone."""
    gate_max_wait_s: float = Field(default=60.0, gt=0)
    """How long a stage waits for its minimum sample; not reaching it fails the gate."""
    gate_max_error_rate_delta: float = Field(default=0.02, ge=0)
    """Largest allowed rise of the error rate of the new version over the current one, also significant
    by Fisher's exact test on the request counts (where the metrics source counts them) at the level
    of ``gate_acceptance_z`` (one-sided)."""
    gate_max_latency_ratio: float = Field(default=1.5, gt=0)
    """Largest allowed ratio of the new version's p50 latency to the current one's, the current one's
    taken over the requests it served since the new version's first (where it served enough of them,
    :func:`serving.deploy.same_window`), so that load on the machine during the stage counts on both
    sides."""
    gate_max_acceptance_drop: float = Field(default=0.05, ge=0)
    """Largest allowed drop of the acceptance proxy (accepts over accepts plus rejects)."""
    gate_max_truncation_rise: float = Field(default=0.1, ge=0)
    """Largest allowed rise of the share of answers cut at the token limit (``finish_reason``
    ``length``), also significant by Fisher's exact test at the level of ``gate_acceptance_z``
    (one-sided): every answer is an observation, so degenerate output (repetition until the limit)
    fails a canary before users judged enough of it."""
    gate_max_malformed_tool_rise: float = Field(default=0.1, ge=0)
    """Largest allowed rise of the share of answers with a tool call no parser could read (the markup
    left in the content), also significant by Fisher's exact test like the cut answers: a broken policy
    can stop early with garbage instead of repeating to the limit, and its agent turns show it."""
    gate_max_length_ratio: float = Field(default=2.0, gt=1)
    """Largest allowed ratio, either way, of the new version's mean answer length in tokens to the current
    one's, also significant by Welch's t-test at the level of ``gate_acceptance_z``: a broken policy can
    stop early with short garbage (no answer cut, no tool call to misparse, lower latency), and every
    answer shows it before users judged enough of them."""
    gate_interim_alpha: float = Field(default=0.001, gt=0, lt=1)
    """While a stage waits for its users' signals the health checks look again after every answer; a
    look fails the stage only at this one-sided p-value (a Haybittle-Peto boundary), the stage's
    decision at the gate's own level, so watching does not multiply false rollbacks."""
    gate_acceptance_z: float = Field(default=1.645, ge=0)
    """A drop fails the gate only when it is also this many standard errors large (the two versions'
    judged signals as independent proportions; 1.645: one-sided 95%), so a canary judged on a
    handful of sessions is not rolled back on noise; 0: the drop alone decides."""
    pause_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a replica may take to drain in-flight requests when paused."""
    prefetch_ahead: bool = True
    """Pull the update to every replica of the pool when the rollout starts (serving continues), so
    later stages pull while the canary is moved and judged; off: each stage pulls when it starts."""
    prefetch_concurrency: int = Field(default=8, ge=1)
    """Most replicas pulling from the store at once."""
    stale_after_s: float = Field(default=120.0, gt=0)
    """A running deployment whose deployer has not beaten for this long crashed: it is failed and reconciled."""


class ServingConfig(BaseModel):
    """Engines, gateway and deployment."""

    gateway_port: int = 8100
    """Port the gateway listens on."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The CPU reference engine."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The user-facing gateway."""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    """Fleet registry and health checks."""
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    """Delta deployment with canary and rollback."""
