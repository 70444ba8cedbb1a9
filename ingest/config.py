"""Configuration sections owned by the ingest layer (composed by ``scheduler.settings``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class KafkaConfig(BaseModel):
    """Where telemetry flows: topic names and client tuning."""

    topic: str = "undertow.telemetry"
    """Topic that carries telemetry events (contract section 1)."""
    dlq_topic: str = "undertow.telemetry.dlq"
    """Topic that receives dead letters (and the table of the same name)."""
    partitions: int = Field(default=4, ge=1)
    """Partitions created for the telemetry topic on the embedded broker."""
    group_id: str = "undertow-ingest"
    """Consumer group of the ingest workers."""
    session_timeout_ms: int = 6000
    """Group session timeout; 6 s makes a Tansu group join take ~3 s instead of ~23 s."""
    heartbeat_interval_ms: int = 2000
    """Heartbeat interval of group members."""
    max_message_bytes: int = 1 << 20
    """Messages larger than this are dead-lettered with reason ``oversized``."""


class RedactionConfig(BaseModel):
    """Secrets in prompts and code replaced by markers before they are stored (:mod:`ingest.redaction`)."""

    enabled: bool = True
    """Redact prompts, segments, completions and ``code.retained`` final texts with ``detect-secrets``."""
    marker: str = "[REDACTED:{type}]"
    """What replaces a secret; ``{type}`` is the detector's name (``AWS Access Key``, ``GitHub Token``, ...)."""
    disabled_detectors: list[str] = Field(default_factory=lambda: ["Public IP (ipv4)"])
    """``detect-secrets`` detectors not run, by secret type (an address in code is not a secret)."""
    base64_entropy_limit: float = Field(default=4.5, ge=0, le=8)
    """Shannon entropy above which a quoted base64 string counts as a secret (the library's default)."""
    hex_entropy_limit: float = Field(default=3.0, ge=0, le=8)
    """Shannon entropy above which a quoted hex string counts as a secret (the library's default)."""

    @field_validator("marker")
    @classmethod
    def _valid_marker(cls, value: str) -> str:
        value.format(type="x")  # raises on a stray brace
        return value


class IngestConfig(BaseModel):
    """How the consumer batches, retries and reports."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a misconfigured secret is not echoed in the error

    batch_size: int = Field(default=500, ge=1)
    """Most records written in one database transaction."""
    poll_timeout_ms: int = 200
    """How long one poll waits for records."""
    retry_initial_s: float = 0.2
    """First backoff after a database error; doubles up to ``retry_max_s``."""
    retry_max_s: float = 5.0
    """Longest backoff between database retries."""
    unreadable_retry_initial_s: float = Field(default=1.0, gt=0)
    """First wait before a partition whose next batch could not be read (its codec's library missing, or
    corrupt) is read again; doubles up to ``unreadable_retry_max_s``. Other partitions flow meanwhile."""
    unreadable_retry_max_s: float = Field(default=30.0, gt=0)
    """Longest wait between two reads of a batch that could not be read."""
    fetch_partition_bytes: int = Field(default=1 << 20, ge=1 << 14)
    """Most bytes one fetch takes per partition (Kafka's own default, ``max.partition.fetch.bytes``). The client
    asks for the next fetch only once a poll has drained the last one, so the consumer waits on the broker once
    per fetch: with a quarter of this, the PostgreSQL ingest spent about a third of its time waiting."""
    create_topics: bool = True
    """Create the telemetry and dead-letter topics when missing (again after an embedded broker restart)."""
    topic_check_s: float = 2.0
    """How often an idle consumer checks that its topic still exists (an embedded broker restart empties it)."""
    writer: Literal["process", "thread"] = "process"
    """Who validates and writes a batch while the next one is polled: two processes (one validates, one writes;
    other cores) or a thread; in-memory SQLite, and a consumer in a daemonic process, always use a thread."""
    gc_threshold: int = Field(default=50_000, ge=0)
    """While consuming: objects allocated between young garbage collections (Python's default is 700);
    long-lived objects are frozen out of the collector at start (in the writer processes too). 0 leaves the
    collector as it is."""
    signing_keys: dict[str, SecretStr] = Field(default_factory=dict)
    """Producer keys, key id -> secret (:mod:`ingest.signing`; ``undertow telemetry-keys new NAME`` makes one). When
    non-empty, every record must carry an HMAC-SHA256 signature by one of them in its ``undertow-key-id`` and
    ``undertow-signature`` headers, else it is a dead letter with reason ``unsigned`` (no signature) or
    ``bad_signature`` (unknown key id, or a signature that does not match); the gateway's key is one of them.
    Empty: nothing is checked. Secrets are at least 16 bytes and are never printed by ``undertow config show``."""
    replay_signing_key_id: str = "dlq-replay"
    """The key of ``signing_keys`` that ``undertow dlq replay`` signs replayed records with (an operator's replay is
    trusted, so it passes verification); when it is not one of ``signing_keys``, replay sends them unsigned and
    says so in its output."""
    unmatched_signal_ttl_s: float = Field(default=86400.0, gt=0)
    """How long a signal may wait for its session: a signal (other than ``user.churned``, which has none) whose
    session has not arrived this many seconds after the signal was received is moved from the signals to the
    dead letters with reason ``unknown_session``, its envelope as the value, so ``undertow dlq replay`` can send
    it again (``undertow ingest sweep`` runs the move by hand)."""
    unmatched_sweep_interval_s: float = Field(default=60.0, gt=0)
    """How often the consumer looks for signals that waited longer than ``unmatched_signal_ttl_s`` (a bounded
    query on the signals' primary key and the sessions' index, then one transaction per chunk)."""

    redaction: RedactionConfig = Field(default_factory=RedactionConfig)
    """Secrets redacted before storage."""
    retention_days: int = Field(default=180, ge=0)
    """Sessions, signals, dead letters and duplicates older than this many days are deleted by the
    ``undertow.enforce_retention`` beat job (``undertow users retention`` runs it by hand); 0 keeps them."""
    retention_interval_s: float = Field(default=3600.0, gt=0)
    """How often the retention beat job runs."""

    @field_validator("signing_keys")
    @classmethod
    def _valid_keys(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        from ingest.signing import keyring

        keyring(value)  # raises on a bad key id or a short secret
        return value
