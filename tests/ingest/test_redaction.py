"""Secrets in prompts and code are replaced by markers before storage (``detect-secrets``): real-looking
AWS keys, private keys, GitHub tokens and high-entropy strings in code, through the consumer's batch path
into the database; ordinary code is left alone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ingest_helpers import session_event, signal_event
from sqlalchemy import select
from sqlalchemy.engine import Engine

from ingest.redaction import RedactionSpec, Redactor

AWS_ID = "AKIAQYLPMN5HHHFPZAM2"
AWS_SECRET = "tQ8ZdTbFz+Xw1v9hJ2kLmN3pR4sT5uV6wX7yZ8aB"
GITHUB = "ghp_R8fL2qW9zX4cV7bN1mK5jH3gF6dS0aPoIuYt"
HEX = "9f2c4e7a1b8d3f6e0a5c2b9d4e7f1a3c8b6d0e2f4a7c9b1d3e5f7a9c2b4d6e8f"
PRIVATE_KEY = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEpAIBAAKCAQEAvQ3pyBmHYm0Ky5TXkO1nV3yWb9kH8jZq2LwXb4fT1sRpUe9c\n"
    "Xq7M8kz0L5h2JtY9WcN4bV6gF1dS3aQ8pO7iU2yT5rE9wQ4zX1cV8bN6mK3jH0g\n"
    "-----END RSA PRIVATE KEY-----"
)
CODE = f'''import boto3

AWS_ACCESS_KEY_ID = "{AWS_ID}"
aws_secret_access_key = "{AWS_SECRET}"
gh = Github("{GITHUB}")
SIGNING_KEY = "{HEX}"
PEM = """{PRIVATE_KEY}"""


def merge_intervals(xs):
    return sorted(xs)
'''
SECRETS = (AWS_ID, AWS_SECRET, GITHUB, HEX, "MIIEpAIBAAKCAQEA", "Xq7M8kz0L5h2")


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionSpec())


def test_each_kind_of_secret_becomes_a_marker(redactor: Redactor) -> None:
    out = redactor.redact(CODE)
    for secret in SECRETS:
        assert secret not in out
    assert 'AWS_ACCESS_KEY_ID = "[REDACTED:AWS Access Key]"' in out
    assert 'Github("[REDACTED:GitHub Token]")' in out
    assert 'SIGNING_KEY = "[REDACTED:Hex High Entropy String]"' in out
    assert "[REDACTED:Private Key]" in out and "END RSA PRIVATE KEY" not in out
    assert out.endswith("def merge_intervals(xs):\n    return sorted(xs)\n")  # the code around is kept


def test_plain_code_and_lookalikes_are_kept(redactor: Redactor) -> None:
    plain = (
        "def merge_intervals_for_the_billing_service(xs):\n"
        "    user_id = 'c0ffee00-1234-4567-89ab-0123456789ab'  # a UUID, not a secret\n"
        "    password = os.environ['DB_PASSWORD']\n"
        "    token = get_token(request)\n"
        "    alphabet = 'abcdefghijklmnopqrstuvwxyz0123456789'\n"
        "    return sorted(xs)\n"
    )
    assert redactor.redact(plain) == plain
    assert redactor(None) is None and redactor("") == ""


def test_a_key_cut_off_is_redacted_to_the_end(redactor: Redactor) -> None:
    truncated = "x = 1\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9u\nAAAA"
    assert redactor.redact(truncated) == "x = 1\n[REDACTED:Private Key]"


def test_marker_and_detectors_are_configurable() -> None:
    custom = Redactor(RedactionSpec(marker="<secret:{type}>", disabled=("AWS Access Key",)))
    out = custom.redact(f'k = "{GITHUB}"\nid = "{AWS_ID}"')
    assert "<secret:GitHub Token>" in out and AWS_ID in out
    with pytest.raises(ValueError, match="unknown secret detectors"):
        Redactor(RedactionSpec(disabled=("No Such Detector",)))


def test_hostile_and_oversized_text_is_handled(redactor: Redactor) -> None:
    long_line = "a" * 200_000  # one long low-entropy token: no secret, returned unchanged
    assert redactor.redact(long_line) == long_line
    weird = "\x00\ufffd" + GITHUB + "\u202e"
    assert GITHUB not in redactor.redact(weird)


def _records(events: list[dict[str, Any]]) -> list[tuple[str, int, int, bytes | None, bytes | None]]:
    return [("t", 0, i, None, json.dumps(e).encode()) for i, e in enumerate(events)]


def test_secrets_never_reach_the_database(engine: Engine) -> None:
    from ingest.batches import BatchContext, prepare_batch
    from ingest.db import transaction
    from ingest.rows import codec_for
    from ingest.tables import SegmentRow, SessionRow, SignalRow
    from ingest.writer import write_prepared

    event = session_event(1)
    event["payload"]["prompt"] = {"text": f"my key is {AWS_ID}, fix the upload"}
    for seg in event["payload"]["segments"]:
        seg["text"] = CODE
    sid = event["session_id"]
    retained = signal_event(
        "ret-1", "code.retained", sid, {"horizon_s": 300, "lines_written": 4, "lines_retained": 4, "final_text": CODE}
    )
    ctx = BatchContext("g", 1 << 20, 0.01, 0.1, redaction=RedactionSpec())
    prepared, letters = prepare_batch(codec_for(engine.dialect.name), ctx, _records([event, retained]))
    assert letters == []
    with transaction(engine) as session:
        assert write_prepared(session, prepared).stored == 2
    with transaction(engine) as session:
        row = session.get(SessionRow, sid)
        assert row is not None
        texts = [row.prompt_text or "", row.completion_text]
        texts += [s.text or "" for s in session.scalars(select(SegmentRow).where(SegmentRow.session_id == sid))]
        payload = session.scalar(select(SignalRow.payload).where(SignalRow.event_id == "ret-1"))
    stored = "\n".join(texts) + json.dumps(payload)
    for secret in SECRETS:
        assert secret not in stored
    assert "[REDACTED:AWS Access Key]" in (texts[0]) and "[REDACTED:GitHub Token]" in payload["final_text"]


def test_redaction_off_stores_text_as_sent(engine: Engine) -> None:
    from ingest.batches import BatchContext, prepare_batch
    from ingest.db import transaction
    from ingest.rows import codec_for
    from ingest.tables import SessionRow
    from ingest.writer import write_prepared

    event = session_event(2)
    event["payload"]["prompt"] = {"text": f"key {AWS_ID}"}
    prepared, _ = prepare_batch(
        codec_for(engine.dialect.name), BatchContext("g", 1 << 20, 0.01, 0.1), _records([event])
    )
    with transaction(engine) as session:
        write_prepared(session, prepared)
    with transaction(engine) as session:
        row = session.get(SessionRow, event["session_id"])
        assert row is not None and row.prompt_text == f"key {AWS_ID}"
