"""Signals the gateway must not trust, over a real CPU engine and the embedded broker: one event id
sent 50 times, a signal dated in the future, a signal from a user who was not served the session.
Each is checked by its effect: what reaches Kafka and what the deployment gate counts."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
from serving_helpers import consume

from serving.config import GatewayConfig
from serving.gateway import Gateway, create_gateway_app, static_replicas
from serving.launch import ServerThread
from serving.telemetry import TelemetryEmitter


def test_replayed_future_and_foreign_signals_move_nothing(one_engine, broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ingest.embedded import create_topics
    from ingest.producer import TelemetryProducer

    topic = f"trust-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap, {topic: 2})
    emitter = TelemetryEmitter(lambda: TelemetryProducer(broker.bootstrap, topic), tmp_path / "spool")
    gw = Gateway(static_replicas([one_engine.url], "v0"), emitter, GatewayConfig(), "undertow-policy")
    with ServerThread(create_gateway_app(gw)) as srv:

        def signal(body: dict) -> httpx.Response:  # type: ignore[type-arg]
            return httpx.post(srv.url + "/v1/signals", json=body, timeout=10)

        served = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "def add", "max_tokens": 4, "user": "alice"}, timeout=60
        )
        assert served.status_code == 200, served.text
        sid = served.json()["choices"][0]["session_id"]

        replayed = {"type": "edit.rejected", "event_id": f"e-{uuid.uuid4()}", "session_id": sid, "payload": {}}
        answers = [signal({**replayed, "user_id": "alice"}) for _ in range(50)]
        assert answers[0].status_code == 202
        assert all(a.status_code == 200 and a.json()["duplicate"] for a in answers[1:])

        future = (datetime.now(UTC) + timedelta(days=365 * 900)).isoformat()
        late = signal(
            {"type": "edit.accepted", "session_id": sid, "user_id": "alice", "occurred_at": future, "payload": {}}
        )
        assert late.status_code == 422 and "later than the gateway's clock" in late.json()["error"]["message"]
        foreign = signal({"type": "edit.accepted", "session_id": sid, "user_id": "mallory", "payload": {}})
        assert foreign.status_code == 403 and "not served to user mallory" in foreign.json()["error"]["message"]

        unnamed = signal({"type": "feedback.thumbs", "session_id": sid, "payload": {"value": -1}})
        assert unnamed.status_code == 202, unnamed.text
        metrics = httpx.get(srv.url + "/gateway/metrics", timeout=10).json()
    gate = metrics["versions"]["v0"]
    assert gate["judged"] == 2 and gate["acceptance"] == 0.0  # the rejection once, the thumbs down once
    assert metrics["errors"]["DuplicateSignal"] == 49
    assert metrics["errors"]["SignalFromTheFuture"] == 1 and metrics["errors"]["SignalFromAnotherUser"] == 1

    events = consume(broker.bootstrap, topic, 4, timeout_s=15)
    emitter.close()
    signals = [e for e in events if e["type"] != "session.completed"]
    assert sorted(e["type"] for e in signals) == ["edit.rejected", "feedback.thumbs"]
    assert all(e["user_id"] == "alice" for e in signals)  # the unnamed one is attributed to the served user
    assert len(events) == 3
