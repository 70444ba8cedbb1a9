"""Signed telemetry: an HMAC-SHA256 over each envelope, so ingest can tell who wrote an event.

A producer holding a key (an id and a secret) sends two Kafka record headers with each event:

- ``undertow-key-id``: the key's id (ASCII, at most 64 characters);
- ``undertow-signature``: ``HMAC-SHA256(secret, value)`` in lowercase hex, over the record's
  value exactly as sent (the UTF-8 JSON envelope).

The gateway signs everything it writes; a client that produces directly is given its own key
(``undertow telemetry-keys new``). When ingest has keys configured (``ingest.signing_keys``), a
record without a signature is a dead letter with reason ``unsigned``, one whose key is unknown or
whose signature does not match is one with reason ``bad_signature``. Without configured keys,
nothing is checked (a development stack, or a deployment that has not turned signing on yet).

Any Kafka client can send headers, so any producer can sign (``confluent-kafka``:
``producer.produce(topic, value, headers=key.headers(value))`` with a :class:`SigningKey` ``key``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import SecretStr

KEY_HEADER = "undertow-key-id"
SIGNATURE_HEADER = "undertow-signature"
MAX_KEY_ID = 64
UNSIGNED = "unsigned"
BAD_SIGNATURE = "bad_signature"


@dataclass(frozen=True)
class SigningKey:
    """One producer's key: its public id and the shared secret (never logged)."""

    key_id: str
    secret: bytes

    def __post_init__(self) -> None:
        if not 0 < len(self.key_id) <= MAX_KEY_ID or not self.key_id.isascii():
            raise ValueError(f"a signing key id is 1 to {MAX_KEY_ID} ASCII characters, not {self.key_id!r}")
        if len(self.secret) < 16:
            raise ValueError(f"the secret of signing key {self.key_id!r} is shorter than 16 bytes")

    def __repr__(self) -> str:
        return f"SigningKey({self.key_id!r}, secret=...)"

    def sign(self, value: bytes) -> str:
        """The hex HMAC-SHA256 of ``value``."""
        return hmac.new(self.secret, value, hashlib.sha256).hexdigest()

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The two record headers that sign ``value``."""
        return [(KEY_HEADER, self.key_id.encode()), (SIGNATURE_HEADER, self.sign(value).encode())]


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def keyring(spec: Mapping[str, SecretStr | str]) -> dict[str, SigningKey]:
    """Keys by id from a ``{key_id: secret}`` mapping (the ``ingest.signing_keys`` setting)."""
    return {key_id: SigningKey(key_id, _plain(secret).encode()) for key_id, secret in spec.items()}


def _plain(secret: SecretStr | str) -> str:
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def _header(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    for key, value in headers or ():
        if key == name:
            return value
    return None


def verify(
    value: bytes | None, headers: Iterable[tuple[str, bytes | None]] | None, keys: Mapping[str, SigningKey]
) -> tuple[str, str] | None:
    """None when ``value`` carries a valid signature by one of ``keys``; else ``(reason, detail)``."""
    key_id = _header(headers, KEY_HEADER)
    signature = _header(headers, SIGNATURE_HEADER)
    if key_id is None or signature is None:
        return UNSIGNED, f"no {KEY_HEADER} and {SIGNATURE_HEADER} headers; sign events with a producer key"
    name = key_id.decode("utf-8", "replace")
    key = keys.get(name)
    if key is None:
        return BAD_SIGNATURE, f"unknown signing key {name[:MAX_KEY_ID]!r}"
    if not hmac.compare_digest(key.sign(value or b"").encode(), signature):
        return BAD_SIGNATURE, f"the signature does not match the event for key {name!r}"
    return None
