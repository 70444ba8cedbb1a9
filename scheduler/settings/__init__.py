"""The root settings tree: ``UNDERTOW_*`` environment variables over an optional ``undertow.toml``.

Each layer owns a section (its ``config.py``; the scheduler's own are in :mod:`.sections`); this
package only composes them, and :mod:`.docs` renders their reference. Nothing is built at import
time: call :func:`load_settings` and pass the sections down explicitly, typed.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from ingest.config import IngestConfig, KafkaConfig
from ingest.private import private_dir
from policy.config import PolicyConfig
from reward_models.config import RewardsConfig
from scheduler.settings.sections import ApiConfig, SchedulerConfig
from serving.config import ServingConfig


class Settings(BaseSettings):
    """Everything Undertow can be configured with. Environment wins over ``undertow.toml``."""

    model_config = SettingsConfigDict(
        env_prefix="UNDERTOW_",
        env_nested_delimiter="__",
        toml_file="undertow.toml",
        extra="ignore",
        hide_input_in_errors=True,  # errors name the setting and the rule, never a value (secrets among them)
    )

    home: Path = Path(".undertow")
    """Working directory for the embedded stack: SQLite file, weights, artifacts, logs."""
    database_url: str | None = None
    """SQLAlchemy URL; default: a SQLite file (WAL) under ``home``. PostgreSQL in production."""
    kafka_bootstrap: str | None = None
    """Kafka bootstrap servers; default: the embedded broker started by the stack launcher."""
    log_level: str = "INFO"
    """Log level of the structured logs written to stderr."""
    log_json: bool = False
    """Write logs as JSON lines instead of the console renderer."""

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    """Telemetry topics and Kafka client tuning."""
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    """Consumer batching and retries."""
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    """Reward labels, models and retraining."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Policy model, RL trainer and weight store."""
    serving: ServingConfig = Field(default_factory=ServingConfig)
    """Engines, gateway and deployment."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Celery, capacity planning and borrowing."""
    api: ApiConfig = Field(default_factory=ApiConfig)
    """The control plane API."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @property
    def resolved_database_url(self) -> str:
        """The database URL in force: the configured one, or the embedded SQLite file."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'undertow.db').resolve()}"

    @property
    def is_embedded_database(self) -> bool:
        """True when no database URL was configured (the embedded SQLite default)."""
        return not self.database_url

    def resolved_kafka_bootstrap(self) -> str | None:
        """The configured bootstrap servers, else those of a running embedded broker, else None."""
        if self.kafka_bootstrap:
            return self.kafka_bootstrap
        state = self.home / "broker.json"
        if state.exists():
            return str(json.loads(state.read_text())["bootstrap"])
        return None

    def resolved(self) -> dict[str, Any]:
        """The resolved configuration as plain data, shown by ``config show`` and recorded with every run.

        Secrets are masked: every ``SecretStr`` (pydantic dumps it as ``**********``) and the password of
        every URL (database, broker, result backend, judge, store), so this may be printed and stored."""
        data = self.model_dump(mode="json")
        data["database_url"] = self.resolved_database_url
        data["kafka_bootstrap"] = self.resolved_kafka_bootstrap()
        return mask_urls(data)


MASK = "**********"
"""What replaces a secret wherever settings are shown or stored (pydantic's own ``SecretStr`` rendering)."""
# a URL password runs to the last @ (an unencoded one may hold one); ";" and "," separate failover URLs
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^\s;,]+@")
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|token|secret|api_key|key)=)[^&\s]+", re.IGNORECASE)


def mask_urls(value: Any) -> Any:
    """``value`` (plain JSON data) with the password of every URL in it, and secret query parameters, masked.

    URL settings stay plain strings (SQLAlchemy, Celery and Kafka clients take them as they are); they are
    masked here, where settings leave the process, instead."""
    if isinstance(value, str):
        value = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", value)
        return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", value)
    if isinstance(value, dict):
        return {key: mask_urls(item) for key, item in value.items()}
    if isinstance(value, list):
        return [mask_urls(item) for item in value]
    return value


class SettingsError(ValueError):
    """The configuration cannot be loaded: each bad setting, where it is set and the rule it breaks."""


def describe_errors(exc: ValidationError) -> str:
    """One line per invalid setting: its dotted name, the rule, its variable and its ``undertow.toml`` key
    (never the value given: secrets are settings too)."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        variable = "UNDERTOW_" + "__".join(part.upper() for part in loc)
        key = f"[{'.'.join(loc[:-1])}] {loc[-1]}" if len(loc) > 1 else loc[0] if loc else "?"
        lines.append(f"  {'.'.join(loc) or '(settings)'}: {err['msg']} (set by {variable} or {key} in undertow.toml)")
    return "\n".join(lines)


def load_settings(**overrides: Any) -> Settings:
    """Build the settings from the environment and ``undertow.toml`` (overrides win).

    Raises :class:`SettingsError` naming every invalid setting, or the line of ``undertow.toml``
    that does not parse."""
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(
            f"{exc.error_count()} invalid setting(s):\n{describe_errors(exc)}\n"
            "`undertow config docs` lists every setting with its type and default."
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"undertow.toml in {Path.cwd()} is not valid TOML: {exc}") from None
    private_dir(settings.home)  # 0700 when created here: it holds the database, weights and the spool
    return settings
