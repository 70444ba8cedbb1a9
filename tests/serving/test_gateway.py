"""The gateway over a real CPU engine: candidate groups, version tags, telemetry through the
embedded broker (and through a disk spool while the broker is down), signals, bad input."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from serving_helpers import consume

from serving.config import GatewayConfig
from serving.gateway import Gateway, create_gateway_app, static_replicas
from serving.launch import ServerThread
from serving.telemetry import TelemetryEmitter


def _gateway(one_engine, bootstrap: str | None, topic: str, spool) -> Gateway:  # type: ignore[no-untyped-def]
    from ingest.producer import TelemetryProducer

    factory = (
        (lambda: TelemetryProducer(bootstrap, topic, max_block_ms=2000, request_timeout_ms=3000)) if bootstrap else None
    )
    emitter = TelemetryEmitter(factory, spool, retry_interval_s=0.3, send_timeout_s=3.0)
    cfg = GatewayConfig(max_body_bytes=4096, max_prompt_chars=500, max_candidates=4)
    return Gateway(static_replicas([one_engine.url], "v0"), emitter, cfg, "undertow-policy")


def test_candidates_are_tagged_and_emitted_with_experts(one_engine, broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ingest.embedded import create_topics

    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap, {topic: 2})
    gw = _gateway(one_engine, broker.bootstrap, topic, tmp_path / "spool")
    with ServerThread(create_gateway_app(gw)) as srv:
        resp = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "def add", "max_tokens": 4, "candidates": 3, "user": "u1"},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["policy_version"] == "v0" and resp.headers["x-undertow-policy-version"] == "v0"
        assert len(body["choices"]) == 3 and body["group_id"]
        assert [c["candidate_index"] for c in body["choices"]] == [0, 1, 2]
        assert "token_ids" not in body["choices"][0] and body["choices"][0]["logprobs"] is None
        sid = body["choices"][1]["session_id"]
        sig = httpx.post(
            srv.url + "/v1/signals",
            json={"type": "edit.accepted", "session_id": sid, "payload": {"lines": 3}},
            timeout=10,
        )
        assert sig.status_code == 202, sig.text
        bad = httpx.post(
            srv.url + "/v1/signals",
            json={"type": "feedback.thumbs", "session_id": sid, "payload": {"value": 5}},
            timeout=10,
        )
        assert bad.status_code == 422 and "invalid signal" in bad.json()["error"]["message"]
        metrics = httpx.get(srv.url + "/gateway/metrics", timeout=10).json()
        assert metrics["versions"]["v0"]["requests"] == 1 and metrics["versions"]["v0"]["acceptance"] == 1.0
        # every choice counts for the gate's health check; 4 tokens from a tiny model end at the limit
        truncated = sum(c["finish_reason"] == "length" for c in body["choices"])
        assert metrics["versions"]["v0"]["answers"] == 3
        assert metrics["versions"]["v0"]["truncation_rate"] == pytest.approx(truncated / 3)
        streamed = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "def add", "max_tokens": 1, "stream": True, "user": "u1"},
            timeout=60,
        )
        assert streamed.status_code == 200 and '"length"' in streamed.text
        after = httpx.get(srv.url + "/gateway/metrics", timeout=10).json()["versions"]["v0"]
        assert after["answers"] == 4 and after["truncation_rate"] == pytest.approx((truncated + 1) / 4)
        # every answer's length in tokens too (the engine returns its token ids to the gateway): at most
        # the 4 and the 1 asked for, a cut answer exactly its limit
        assert after["answer_tokens_n"] == 4 and 4 * truncated + 1 <= round(after["answer_tokens_mean"] * 4) <= 13
        assert metrics["versions"]["v0"]["answer_tokens_n"] == 3
    events = consume(broker.bootstrap, topic, 5)
    sessions = [e for e in events if e["type"] == "session.completed" and e["payload"].get("group_id")]
    assert len(sessions) == 3 and {e["payload"]["group_id"] for e in sessions} == {body["group_id"]}
    one = sessions[0]["payload"]
    assert one["policy_version"] == "v0" and one["routed_experts"] and one["prompt"]["token_ids"]
    assert len(one["segments"][0]["logprobs"]) == len(one["segments"][0]["token_ids"])
    assert any(e["type"] == "edit.accepted" for e in events)


def test_kafka_down_buffers_to_disk_and_sends_later(one_engine, fresh_broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ingest.embedded import create_topics

    topic = "undertow.telemetry.spooltest"
    create_topics(fresh_broker.bootstrap, {topic: 2})
    fresh_broker.kill()
    gw = _gateway(one_engine, fresh_broker.bootstrap, topic, tmp_path / "spool")
    with ServerThread(create_gateway_app(gw)) as srv:
        for _ in range(3):
            t0 = time.perf_counter()
            resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert resp.status_code == 200 and time.perf_counter() - t0 < 10
        deadline = time.monotonic() + 30
        while gw.emitter.spool_bytes() == 0 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.2)
        assert gw.emitter.spool_bytes() > 0  # type: ignore[union-attr]
        fresh_broker.start()
        create_topics(fresh_broker.bootstrap, {topic: 2})
        events = consume(fresh_broker.bootstrap, topic, 3, timeout_s=60)
    assert len({e["event_id"] for e in events}) == 3


def test_spool_is_bounded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    emitter = TelemetryEmitter(None, tmp_path, max_spool_bytes=1024, queue_size=1)
    big = {"type": "x", "pad": "y" * 600}
    for _ in range(3000):
        emitter.emit(big)
    time.sleep(1.5)
    emitter.close()
    assert emitter.spool_bytes() <= (1 << 20) + 1024
    assert emitter.stats["dropped"] > 0


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        (b"{not json", 400, "invalid request"),
        (json.dumps({"prompt": "x" * 501}).encode(), 400, "characters"),
        (json.dumps({"prompt": "x" * 5000}).encode(), 413, "larger than the limit"),
        (json.dumps({"prompt": "x", "candidates": 9}).encode(), 400, "limit of 4"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": ["a", 1]}).encode(), 400, "prompt"),
        (json.dumps([1, 2]).encode(), 400, "invalid request"),
        (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "max_tokens"),
    ],
)
def test_malformed_or_oversized_requests_get_4xx(one_engine, tmp_path, payload, status, needle) -> None:  # type: ignore[no-untyped-def]
    gw = _gateway(one_engine, None, "unused", tmp_path / "spool")
    with ServerThread(create_gateway_app(gw)) as srv:
        resp = httpx.post(
            srv.url + "/v1/completions", content=payload, headers={"content-type": "application/json"}, timeout=30
        )
        assert resp.status_code == status, resp.text
        assert needle in resp.json()["error"]["message"]
        sig = httpx.post(srv.url + "/v1/signals", json={"type": "session.completed"}, timeout=10)
        assert sig.status_code == 400
        sig = httpx.post(srv.url + "/v1/signals", content=b"[]", timeout=10)
        assert sig.status_code == 400


def test_malformed_tool_calls_are_counted_per_version() -> None:
    """An engine whose answers open a tool call they cannot finish (the markup left in the content, as
    vLLM's parser leaves it): the gateway counts those answers for the gate's health check, whole and
    streamed, and a well-formed call or plain text does not count."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from policy.chat_template import TOOL_CALL_END, TOOL_CALL_START

    broken = f'{TOOL_CALL_START}:\\ "{TOOL_CALL_START} arguments": +code{TOOL_CALL_END}'
    good_call = {"id": "c1", "type": "function", "function": {"name": "submit", "arguments": "{}"}}
    replies = iter([(broken, []), ("def f(x): return x", []), (None, [good_call]), (broken, [])])
    engine = FastAPI()

    @engine.post("/v1/chat/completions")
    async def chat(body: dict) -> object:  # type: ignore[type-arg]
        content, calls = next(replies)
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
            return {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice]}

        def chunks():  # type: ignore[no-untyped-def]
            delta = {"role": "assistant", "content": content}
            yield "data: " + json.dumps({"id": "x", "choices": [{"index": 0, "delta": delta}]}) + "\n\n"
            end = {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            yield "data: " + json.dumps(end) + "\n\n" + "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    with ServerThread(engine) as fake:
        gw = Gateway(static_replicas([fake.url], "v1"), None, GatewayConfig(), "undertow-policy")
        with ServerThread(create_gateway_app(gw)) as srv:
            messages = [{"role": "user", "content": "write f"}]
            for stream in (False, False, False, True):
                resp = httpx.post(
                    srv.url + "/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 8, "stream": stream, "user": "u1"},
                    timeout=30,
                )
                assert resp.status_code == 200, resp.text
                if not stream:
                    resp.json()  # whole answers are JSON
            stats = httpx.get(srv.url + "/gateway/metrics", timeout=10).json()["versions"]["v1"]
    assert stats["answers"] == 4 and stats["malformed_tool_call_rate"] == pytest.approx(2 / 4)
