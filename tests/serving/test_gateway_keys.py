"""The gateway with API keys, over a real CPU engine and a migrated database: who may call it, whose
signals count, how fast, and how much one user weighs in the canary gate. Each case is checked by
what the gateway answers and what ``/gateway/metrics`` then shows."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from serving.config import GatewayConfig
from serving.gateway import Gateway, create_gateway_app, static_replicas
from serving.keys import ClientKey, KeyRing, create_key, revoke_key
from serving.launch import ServerThread

METRICS_KEY = "ugw_metrics-key-for-the-test-only"


@contextmanager
def keyed_gateway(engine_url: str, db: Any, **config: Any) -> Iterator[str]:
    cfg = GatewayConfig(key_refresh_s=0.2, **config)
    ring = KeyRing(db, cfg.key_refresh_s, {METRICS_KEY: ClientKey("metrics-setting", ("metrics",))})
    gw = Gateway(static_replicas([engine_url], "v0"), None, cfg, "undertow-policy", ring)
    with ServerThread(create_gateway_app(gw)) as srv:
        yield srv.url


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def complete(url: str, key: str, user: str | None = None, **extra: Any) -> httpx.Response:
    body = {"prompt": "def add", "max_tokens": 2, **extra}
    if user is not None:
        body["user"] = user
    return httpx.post(url + "/v1/completions", json=body, headers=bearer(key), timeout=60)


def signal(url: str, key: str, **body: Any) -> httpx.Response:
    body.setdefault("payload", {})
    return httpx.post(url + "/v1/signals", json=body, headers=bearer(key), timeout=10)


def metrics(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/gateway/metrics", headers=bearer(METRICS_KEY), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture
def db(sqlite_url: str) -> Any:
    from ingest.db import ensure_schema, make_engine

    engine = make_engine(sqlite_url)
    ensure_schema(engine, auto_upgrade=True)
    return engine


def test_keys_gate_every_endpoint_and_revocation_takes_effect(one_engine, db) -> None:  # type: ignore[no-untyped-def]
    _row, key = create_key(db, "editor-plugin")
    with keyed_gateway(one_engine.url, db) as url:
        for method, path in (("post", "/v1/completions"), ("post", "/v1/signals"), ("get", "/gateway/metrics")):
            bare = httpx.request(method, url + path, json={"prompt": "x"}, timeout=10)
            assert bare.status_code == 401 and "API key" in bare.json()["error"]["message"], (path, bare.text)
            forged = httpx.request(method, url + path, json={}, headers=bearer("ugw_" + "x" * 43), timeout=10)
            assert forged.status_code == 401, (path, forged.text)
        assert httpx.get(url + "/gateway/metrics", headers=bearer(key), timeout=10).status_code == 403

        client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(
            model="undertow-policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="ann"
        )
        assert answer.choices[0].message is not None
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="ugw_wrong", max_retries=0).chat.completions.create(
                model="undertow-policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )

        assert revoke_key(db, "editor-plugin")
        time.sleep(0.5)  # past key_refresh_s
        assert complete(url, key, "ann").status_code == 401
        errors = metrics(url)["errors"]
    assert errors["AuthenticationError"] >= 8 and errors["PermissionDeniedError"] == 1


def test_user_bound_keys_clients_and_churn(one_engine, db) -> None:  # type: ignore[no-untyped-def]
    _r, plugin = create_key(db, "plugin")
    _r, other_client = create_key(db, "other-client")
    _r, ann_key = create_key(db, "ann-laptop", user_id="ann")
    with keyed_gateway(one_engine.url, db) as url:
        # a key bound to ann serves ann only, whatever the body says
        assert complete(url, ann_key, "bob").status_code == 403
        served = complete(url, ann_key)
        assert served.status_code == 200, served.text
        ann_session = served.json()["choices"][0]["session_id"]
        assert signal(url, ann_key, type="edit.accepted", session_id=ann_session, user_id="bob").status_code == 403
        assert signal(url, ann_key, type="edit.accepted", session_id=ann_session).status_code == 202
        assert (
            signal(url, ann_key, type="user.churned", user_id="bob", payload={"inactive_days": 30}).status_code == 403
        )
        assert signal(url, ann_key, type="user.churned", payload={"inactive_days": 30}).status_code == 202

        # a client-wide key vouches for its own users only
        bob_session = complete(url, plugin, "bob").json()["choices"][0]["session_id"]
        stolen = signal(url, other_client, type="edit.rejected", session_id=bob_session, user_id="bob")
        assert stolen.status_code == 403 and stolen.json()["error"]["type"] == "SignalFromAnotherClient"
        assert (
            signal(url, other_client, type="user.churned", user_id="bob", payload={"inactive_days": 30}).status_code
            == 403
        )
        assert (
            signal(url, plugin, type="user.churned", user_id="carol", payload={"inactive_days": 30}).status_code == 403
        )
        assert signal(url, plugin, type="user.churned", user_id="bob", payload={"inactive_days": 30}).status_code == 202

        # a session id chosen by one user cannot be taken over by another
        chat = {"model": "undertow-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        mine = httpx.post(
            url + "/v1/chat/completions",
            json={**chat, "user": "bob"},
            headers={**bearer(plugin), "x-session-id": "agent-run-7"},
            timeout=60,
        )
        assert mine.status_code == 200, mine.text
        theirs = httpx.post(
            url + "/v1/chat/completions",
            json={**chat, "user": "dave"},
            headers={**bearer(plugin), "x-session-id": "agent-run-7"},
            timeout=60,
        )
        assert theirs.status_code == 409 and theirs.json()["error"]["type"] == "SessionOfAnotherUser"
        errors = metrics(url)["errors"]
    assert errors["SignalFromAnotherUser"] == 2 and errors["SignalFromAnotherClient"] == 1
    assert errors["ChurnForUnknownUser"] == 2 and errors["SessionOfAnotherUser"] == 1


def test_rates_per_user_and_client(one_engine, db) -> None:  # type: ignore[no-untyped-def]
    _r, plugin = create_key(db, "plugin")
    _r, slow = create_key(db, "slow-client", rate_per_s=0.01)
    with keyed_gateway(one_engine.url, db, user_signal_rate_per_s=0.01, user_signal_burst=5, client_burst=100) as url:
        sid = complete(url, plugin, "eve").json()["choices"][0]["session_id"]
        answers = [signal(url, plugin, type="feedback.thumbs", session_id=sid, payload={"value": -1}) for _ in range(8)]
        assert [a.status_code for a in answers] == [202] * 5 + [429] * 3
        assert int(answers[-1].headers["retry-after"]) >= 1
        assert "eve is over their signal rate" in answers[-1].json()["error"]["message"]
        # another user of the same client is not held back by eve
        other = complete(url, plugin, "frank").json()["choices"][0]["session_id"]
        assert signal(url, plugin, type="edit.accepted", session_id=other).status_code == 202

        # a client over its own rate: its burst scales with its rate (here: below one request)
        limited = complete(url, slow, "gina")
        assert limited.status_code == 429, limited.text
        gate = metrics(url)
    assert gate["errors"]["RateLimitError"] == 4
    assert gate["versions"]["v0"]["judged"] == 6  # eve's five thumbs, frank's accept


def test_one_user_weighs_at_most_the_cap_in_the_gate(one_engine, db) -> None:  # type: ignore[no-untyped-def]
    _r, plugin = create_key(db, "plugin")
    with keyed_gateway(one_engine.url, db, gate_signals_per_user=3, user_signal_burst=100) as url:
        honest = [f"dev-{i}" for i in range(4)]
        for user in honest:
            for _ in range(2):
                sid = complete(url, plugin, user).json()["choices"][0]["session_id"]
                assert signal(url, plugin, type="edit.accepted", session_id=sid).status_code == 202
        sessions = [complete(url, plugin, "mallory").json()["choices"][0]["session_id"] for _ in range(4)]
        for i in range(40):
            sent = signal(url, plugin, type="edit.rejected", session_id=sessions[i % 4], event_id=f"m-{uuid.uuid4()}")
            assert sent.status_code == 202
        gate = metrics(url)["versions"]["v0"]
    assert gate["judged"] == 48 and gate["judged_users"] == 5
    assert gate["acceptance_raw"] == pytest.approx(8 / 48)
    # mallory weighs 3 however much she sends, and alone at the bottom she is trimmed away
    assert gate["acceptance"] == pytest.approx(1.0)


def test_gate_acceptance_bounds_any_one_user() -> None:
    from serving.gateway import VersionStats

    rng = __import__("random").Random(7)
    honest = {f"dev-{i}": [float(rng.random() < 0.7) for _ in range(rng.randint(1, 6))] for i in range(30)}

    def acceptance(attacker: list[float], cap: int) -> float:
        stats = VersionStats(per_user_cap=cap)
        for user, values in honest.items():
            for v in values:
                stats.judge(user, v)
        for v in attacker:
            stats.judge("mallory", v)
        result = stats.acceptance()
        assert result is not None
        return result

    clean = acceptance([], 5)
    # whatever one account sends, and however often, it moves the robust mean by little
    for attack in ([0.0] * 500, [1.0] * 500, [0.5] * 500, [0.0, 1.0] * 250):
        assert abs(acceptance(attack, 5) - clean) < 0.03, attack[:2]
    assert abs(acceptance([0.0] * 500, 5) - clean) < 0.01  # alone at an extreme: trimmed away
    assert abs(acceptance([0.0] * 500, 0) - acceptance([], 0)) > 0.5  # the plain mean is carried off


def test_hostile_signal_bodies_get_a_clear_400() -> None:
    from fastapi.testclient import TestClient

    gw = Gateway(static_replicas([]), None, GatewayConfig(), "undertow-policy")
    client = TestClient(create_gateway_app(gw), raise_server_exceptions=False)
    for body in ("[" * 100_000 + "]" * 100_000, '{"type": "edit.accepted", "payload": ', "\x00\xff"):
        answer = client.post("/v1/signals", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, (body[:20], answer.text)
        assert "not JSON" in answer.json()["error"]["message"]
    assert gw.errors["BadRequestError"] == 3


def test_signals_on_agent_sessions_and_on_single_requests_are_judged_apart(one_engine, db) -> None:  # type: ignore[no-untyped-def]
    """The gate compares agent sessions with agent sessions: ``/gateway/metrics`` keeps their signals
    apart from single requests', each kind with the same robust mean."""
    _r, plugin = create_key(db, "plugin")
    with keyed_gateway(one_engine.url, db, gate_signals_per_user=3, user_signal_burst=100) as url:
        agent = f"agent-{uuid.uuid4().hex[:8]}"
        for turn in range(2):
            chat = {"model": "undertow-policy", "messages": [{"role": "user", "content": "def add"}], "max_tokens": 2}
            headers = {**bearer(plugin), "x-session-id": agent, "x-turn-index": str(turn)}
            body = {**chat, "user": "dev"}
            response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
        assert signal(url, plugin, type="edit.rejected", session_id=agent, user_id="dev").status_code == 202
        assert signal(url, plugin, type="edit.rejected", session_id=f"{agent}.t1", user_id="dev").status_code == 202
        for _ in range(3):
            sid = complete(url, plugin, "dev").json()["choices"][0]["session_id"]
            assert signal(url, plugin, type="edit.accepted", session_id=sid, user_id="dev").status_code == 202
        kinds = metrics(url)["versions"]["v0"]["by_kind"]
    assert kinds == {  # the two signals on the agent session and on its turn are about one session
        "agent": {"acceptance": 0.0, "judged": 2, "judged_sessions": 1},
        "single": {"acceptance": 1.0, "judged": 3, "judged_sessions": 3},
    }


def test_a_session_several_versions_served_judges_none_of_them() -> None:
    """An agent session a rolled-back canary wrote turns of, finished on the version after it, is not
    the later version's fault: its signals judge neither (they used to count against the last one)."""
    from fastapi.testclient import TestClient

    gw = Gateway(static_replicas([]), None, GatewayConfig(), "undertow-policy")
    client = TestClient(create_gateway_app(gw))
    gw.trust.served("agent-mixed", "v1", "dev")
    gw.trust.served("agent-mixed", "v2", "dev")
    gw.trust.served("agent-one", "v2", "dev")
    gw.trust.served("agent-one", "v2", "dev")
    for sid in ("agent-mixed", "agent-one"):
        body = {"type": "edit.rejected", "session_id": sid, "user_id": "dev", "payload": {}}
        assert client.post("/v1/signals", json=body).status_code == 202
    metrics = gw.metrics()
    assert {v: s["judged"] for v, s in metrics["versions"].items()} == {"v2": 1}
    assert metrics["unjudged"] == {"mixed_versions": 1}


def test_one_sessions_signals_are_one_observation_for_the_gate() -> None:
    """An accept and its retention at three horizons are four signals about one session: the gate's
    sample size counts sessions, so one failed request cannot look like four independent failures.
    The figures are a real canary's (a version better offline, rolled back on one request)."""
    from serving.config import DeployConfig
    from serving.deploy import gate
    from serving.gateway import VersionStats

    def stats(single: list[list[float]], agent: list[float]) -> dict[str, object]:
        version = VersionStats()
        for i, signals in enumerate(single):  # a request: its accept or reject and its retention
            for value in signals:
                version.judge(f"dev-{i}", value, "single", f"s-{i}")
        for i, value in enumerate(agent):
            version.judge(f"dev-{i}", value, "agent", f"a-{i}")
        return {**version.summary(), "error_rate": 0.0}

    new = {**stats([[0.0] * 4], [1.0] * 3 + [0.0] * 5), "requests": 16}
    assert new["judged"] == 12 and new["judged_sessions"] == 9
    old = {**stats([[1.0] * 4] * 12 + [[0.0] * 4] * 2, [1.0] * 39 + [0.0] * 69), "requests": 129}
    config = DeployConfig(gate_min_requests=16, gate_max_acceptance_drop=0.2)
    assert gate(new, old, config)[0]  # one failed request and agents on par: nothing to roll back on
    as_signals = {
        **new,
        "judged_sessions": None,
        "by_kind": {k: {**v, "judged_sessions": None} for k, v in new["by_kind"].items()},
    }  # type: ignore[attr-defined]
    old_signals = {
        **old,
        "judged_sessions": None,
        "by_kind": {k: {**v, "judged_sessions": None} for k, v in old["by_kind"].items()},
    }  # type: ignore[attr-defined]
    ok, why = gate(as_signals, old_signals, config)
    assert not ok and "acceptance dropped" in why  # counted as twelve observations, it "dropped"
    assert not gate(new, old, DeployConfig(gate_min_requests=16, gate_min_judged=10))[0]
    collapsed = {**stats([[0.0] * 4] * 6, [0.0] * 10), "requests": 16}  # the gate drill: nobody accepts
    assert not gate(collapsed, old, config)[0]
