"""Signed telemetry over the real broker and consumer: signed events stored, the rest dead letters with a reason.

With ``ingest.signing_keys`` set, a record needs an HMAC-SHA256 of its exact value bytes by one of the keys
(headers ``undertow-key-id`` and ``undertow-signature``): unsigned records are dead letters ``unsigned``, an
unknown key or a wrong signature ``bad_signature``; the partition keeps flowing. Without keys nothing is checked.
An operator's replay of such a dead letter is signed with the replay key and stored once.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from ingest_helpers import cli_env, last_json, raw, session_event, signal_event, stored_ids
from sqlalchemy import select

from ingest.config import IngestConfig, KafkaConfig
from ingest.consumer import ConsumerStats, IngestConsumer
from ingest.db import make_engine, transaction, upgrade
from ingest.dlq import list_dead_letters, replay, replay_key
from ingest.producer import TelemetryProducer
from ingest.signing import KEY_HEADER, SIGNATURE_HEADER, SigningKey, keyring, new_secret
from ingest.tables import DeadLetterRow

EDITOR = SigningKey("editor-plugin", new_secret().encode())
REPLAY = SigningKey("dlq-replay", new_secret().encode())
KEYS = {key.key_id: key.secret.decode() for key in (EDITOR, REPLAY)}


def consume_once(engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig) -> ConsumerStats:
    return IngestConsumer(engine, broker.bootstrap, kafka_cfg, ingest_cfg, mode="assign").run(once=True, max_seconds=60)


def signed_cfg(ingest_cfg: IngestConfig, **more: Any) -> IngestConfig:
    return ingest_cfg.model_copy(update={"signing_keys": KEYS, **more})


def letters_by_event(engine: Any) -> dict[str, tuple[str, str]]:
    """``{event_id: (reason, detail)}`` of the dead letters (their values are envelopes)."""
    return {
        json.loads(base64.b64decode(d["value_b64"]))["event_id"]: (d["reason"], d["detail"])
        for d in list_dead_letters(engine)
    }


def test_signed_events_are_stored_and_the_others_are_dead_letters(
    engine: Any, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    """kafka-python through the SDK: signed events are stored; unsigned, forged (wrong secret), unknown key,
    tampered value and half-signed records are dead letters with their reason, each sent event counted once.
    The keys reach the writer's processes (the default writer; on PostgreSQL its one process with lanes)."""
    sent: dict[str, str] = {}
    with TelemetryProducer(broker.bootstrap, kafka_cfg.topic, signing_key=EDITOR) as signed:
        for event in (session_event(1), signal_event("th-1", "feedback.thumbs", "sess-7-1", {"value": 1})):
            signed.send(event)
            sent[event["event_id"]] = "stored"
    forged = SigningKey(EDITOR.key_id, b"not-the-editor-secret")
    stranger = SigningKey("stranger", new_secret().encode())
    for key, event in ((forged, session_event(2)), (stranger, session_event(3))):
        with TelemetryProducer(broker.bootstrap, kafka_cfg.topic, signing_key=key) as other:
            other.send(event)
        sent[event["event_id"]] = "bad_signature"
    unsigned = session_event(4)
    producer.send(unsigned)  # the fixture's producer has no key
    sent[unsigned["event_id"]] = "unsigned"
    # Headers for other bytes than those sent, and a key id without a signature.
    tampered, signed_for = session_event(5), raw(session_event(5, user_id="someone-else"))
    producer.send_raw(raw(tampered), key=b"sess-7-5", headers=EDITOR.headers(signed_for))
    sent[tampered["event_id"]] = "bad_signature"
    half = session_event(6)
    producer.send_raw(raw(half), key=b"sess-7-6", headers=[(KEY_HEADER, EDITOR.key_id.encode())])
    sent[half["event_id"]] = "unsigned"
    producer.flush()

    result = consume_once(engine, broker, kafka_cfg, signed_cfg(ingest_cfg))

    assert (result.records, result.stored, result.dead_letters) == (len(sent), 2, len(sent) - 2)
    assert sorted(stored_ids(engine)) == sorted(eid for eid, fate in sent.items() if fate == "stored")
    letters = letters_by_event(engine)
    assert {eid: reason for eid, (reason, _) in letters.items()} == {
        eid: fate for eid, fate in sent.items() if fate != "stored"
    }
    assert "unknown signing key 'stranger'" in letters["ev-7-3"][1]
    assert "does not match" in letters["ev-7-2"][1] and "does not match" in letters["ev-7-5"][1]
    with transaction(engine) as s:  # the raw bytes are kept, as for any dead letter
        assert s.scalar(select(DeadLetterRow.value).where(DeadLetterRow.reason == "unsigned").limit(1))


def test_librdkafka_signing_through_headers_with_compression_is_stored(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig
) -> None:
    """A producer this project did not write (librdkafka, idempotent, zstd batches) signs with two headers
    beside its own; an unsigned record between them is a dead letter and the partition keeps flowing."""
    from confluent_kafka import Producer

    from ingest.embedded import create_topics

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
    producer = Producer(
        {"bootstrap.servers": broker.bootstrap, "compression.type": "zstd", "enable.idempotence": True, "linger.ms": 20}
    )
    events = [session_event(i) for i in range(10, 20)]
    for event in events:
        value = raw(event)
        headers = [("trace-id", b"abc"), *EDITOR.headers(value)]
        producer.produce(kafka_cfg.topic, value, key=b"one-partition", headers=headers)
    producer.produce(kafka_cfg.topic, raw(session_event(20)), key=b"one-partition")  # unsigned
    producer.produce(kafka_cfg.topic, raw(session_event(21)), key=b"one-partition", headers=EDITOR.headers(b"x"))
    assert producer.flush(30) == 0

    result = consume_once(engine, broker, kafka_cfg, signed_cfg(ingest_cfg))

    assert (result.stored, result.dead_letters) == (len(events), 2)
    assert sorted(stored_ids(engine)) == sorted(e["event_id"] for e in events)
    reasons = {eid: reason for eid, (reason, _) in letters_by_event(engine).items()}
    assert reasons == {"ev-7-20": "unsigned", "ev-7-21": "bad_signature"}
    engine.dispose()


def test_without_keys_nothing_is_checked(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    """No keys configured: unsigned events are stored as before, and so are signed ones (headers ignored)."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    producer.send(session_event(30))
    producer.send_raw(raw(session_event(31)), key=b"k", headers=[(SIGNATURE_HEADER, b"garbage")])
    with TelemetryProducer(broker.bootstrap, kafka_cfg.topic, signing_key=EDITOR) as signed:
        signed.send(session_event(32))
    producer.flush()
    assert ingest_cfg.signing_keys == {}
    result = consume_once(engine, broker, kafka_cfg, ingest_cfg)
    assert (result.stored, result.dead_letters) == (3, 0)
    engine.dispose()


def test_replay_of_an_unsigned_dead_letter_is_signed_and_stored_once(
    sqlite_url: str, broker: Any, kafka_cfg: KafkaConfig, ingest_cfg: IngestConfig, producer: Any
) -> None:
    """An operator's replay is trusted: signed with the replay key, the dead letter is stored, once."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    cfg = signed_cfg(ingest_cfg)
    event = signal_event("th-unsigned", "feedback.thumbs", "sess-7-40", {"value": -1})
    producer.send(event)
    producer.flush()
    assert consume_once(engine, broker, kafka_cfg, cfg).dead_letters == 1

    key, why_unsigned = replay_key(cfg)
    assert key is not None and key.key_id == REPLAY.key_id and why_unsigned is None
    replayed = replay(engine, producer, reason="unsigned", signing_key=key)
    assert len(replayed) == 1
    second = consume_once(engine, broker, kafka_cfg, cfg)
    assert (second.stored, second.dead_letters) == (1, 0)
    assert stored_ids(engine) == ["th-unsigned"]
    # Replayed again: a duplicate, never a second row.
    replay(engine, producer, ids=replayed, signing_key=key)
    third = consume_once(engine, broker, kafka_cfg, cfg)
    assert (third.stored, third.duplicates, third.dead_letters) == (0, 1, 0)
    assert stored_ids(engine) == ["th-unsigned"]

    # Without the replay key among the configured ones, replay goes unsigned and says why.
    key, why_unsigned = replay_key(cfg.model_copy(update={"replay_signing_key_id": "absent"}))
    assert key is None and why_unsigned and "'absent'" in why_unsigned
    assert replay_key(ingest_cfg) == (None, None)  # signing off: nothing to say
    engine.dispose()


def _cli(args: list[str], env: dict[str, str]) -> Any:
    from typer.testing import CliRunner

    from scheduler.cli import app

    return CliRunner().invoke(app, args, env=env, catch_exceptions=False)


def test_cli_key_guidance_configures_ingest_and_replay_signs(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig, producer: Any
) -> None:
    """``undertow telemetry-keys new`` prints a key whose ``env`` line configures ingest; ``dlq replay`` signs with
    the replay key and says so, or says why it could not."""
    import shlex

    made = last_json(_cli(["telemetry-keys", "new", "dlq-replay", "--json"], {}).stdout)
    assert made["key_id"] == "dlq-replay" and len(made["secret"]) >= 32
    name, _, value = made["env"].partition("=")
    assert name == "UNDERTOW_INGEST__SIGNING_KEYS"
    env = cli_env(tmp_path, broker.bootstrap, kafka_cfg)
    env[name] = shlex.split(value)[0]
    producer.send(session_event(50))
    producer.flush()
    first = _cli(["ingest", "--once"], env)
    assert first.exit_code == 0, first.output
    assert last_json(first.stdout)["dead_letters"] == 1
    out = last_json(_cli(["dlq", "replay", "--reason", "unsigned"], env).stdout)
    assert (out["replayed"], out["signed_with"]) == (1, "dlq-replay") and "warning" not in out
    second = _cli(["ingest", "--once"], env)
    assert last_json(second.stdout)["stored"] == 1
    shown = last_json(_cli(["config", "show"], env).stdout)["ingest"]["signing_keys"]
    assert shown == {"dlq-replay": "**********"}  # secrets are never printed

    other = dict(env, UNDERTOW_INGEST__REPLAY_SIGNING_KEY_ID="not-configured")
    out = last_json(_cli(["dlq", "replay", "--all"], other).stdout)
    assert out["signed_with"] is None and "not-configured" in out["warning"]


def test_records_and_settings_without_a_signature_or_with_a_weak_secret() -> None:
    """The parse step: a record without headers is unsigned when keys are set; the settings refuse short secrets."""
    from ingest.batches import parse_records
    from scheduler.settings import Settings

    value = raw(session_event(60))
    keys = keyring(KEYS)
    plain = ("t", 0, 0, None, value)
    signed = ("t", 0, 1, None, value, EDITOR.headers(value))
    deliveries, letters = parse_records([plain, signed], 1 << 20, keys)
    assert [d.offset for d in deliveries] == [1] and [(dl.offset, dl.reason) for dl in letters] == [(0, "unsigned")]
    deliveries, letters = parse_records([plain], 1 << 20)  # no keys: no check
    assert len(deliveries) == 1 and not letters
    assert EDITOR.secret.decode() not in repr(EDITOR)
    with pytest.raises(ValueError, match="shorter than 16 bytes") as refused:
        Settings(ingest={"signing_keys": {"weak": "s3cr3t-value"}})
    assert "s3cr3t-value" not in str(refused.value)  # the error names the rule, never the secret
