"""The producer SDK: what serving's gateway and users' editors call to emit telemetry.

Each event is validated against the wire contract before it leaves (a bad event raises
:class:`~ingest.schemas.InvalidEvent` at the caller, not in the dead-letter store), keyed by its
``session_id`` (``user.churned`` without a session: its ``user_id``) so a session's events stay
in one partition and in order, and sent with ``acks=all``.

With a :class:`~ingest.signing.SigningKey`, each event is signed: two record headers carry the key's
id and the HMAC-SHA256 of the exact value bytes (:mod:`ingest.signing`), as ingest requires when it
has signing keys configured.

Example::

    key = SigningKey("editor-plugin", secret.encode())  # from `undertow telemetry-keys new editor-plugin`
    with TelemetryProducer("127.0.0.1:9092", signing_key=key) as producer:
        producer.send({"event_id": "...", "type": "feedback.thumbs", ...})
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from pydantic import BaseModel

from ingest import schemas
from ingest.signing import SigningKey


def event_key(event: schemas.Event) -> bytes | None:
    """The Kafka key of an event: its session id, else its user id, as UTF-8."""
    key = event.session_id or event.user_id
    return key.encode() if key else None


class TelemetryProducer:
    """A validated, keyed, ``acks=all`` Kafka producer of telemetry events."""

    def __init__(
        self,
        bootstrap: str,
        topic: str = "undertow.telemetry",
        signing_key: SigningKey | None = None,
        **kafka_options: Any,
    ) -> None:
        from kafka import KafkaProducer

        options: dict[str, Any] = {
            "acks": "all",
            # Idempotent sequences do not survive an embedded (in-memory) broker restart; the
            # consumer de-duplicates on event_id anyway.
            "enable_idempotence": False,
            "linger_ms": 5,
            "retries": 2**31 - 1,
            "max_in_flight_requests_per_connection": 1,
            "client_id": "undertow-producer",
        }
        options.update(kafka_options)
        self.topic = topic
        self.signing_key = signing_key
        """Signs every :meth:`send` (None: events go unsigned)."""
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, **options)

    def send(self, event: BaseModel | dict[str, Any], topic: str | None = None) -> Any:
        """Validate and send one event, signed with the producer's key if it has one; returns kafka-python's
        future (``.get()`` waits for the ack)."""
        model = schemas.validate_event(event)
        value = schemas.encode_event(model)
        headers = self.signing_key.headers(value) if self.signing_key is not None else None
        return self._producer.send(topic or self.topic, key=event_key(model), value=value, headers=headers)

    def send_raw(
        self,
        value: bytes,
        key: bytes | None = None,
        topic: str | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> Any:
        """Send bytes as they are, unvalidated and with exactly the ``headers`` given (dead-letter replay, fault
        tests); to sign them, pass ``headers=key.headers(value)``."""
        return self._producer.send(topic or self.topic, key=key, value=value, headers=headers)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every send so far is acknowledged (or failed)."""
        self._producer.flush(timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush and close the connection."""
        self._producer.close(timeout=timeout)

    def __enter__(self) -> TelemetryProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
