"""An engine beside a production stack: its control routes answer only the control token, and it applies
only versions signed by a key it trusts. Each refusal is checked by its effect on the running engine
process (still serving, not paused, not asleep, same version and weights hash), through a plain HTTP
client as well as the deployer's :class:`serving.client.EngineClient`."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator

import httpx
import pytest
from serving_helpers import CONTROL_TOKEN, pull_and_switch

from serving.client import EngineClient, EngineError
from serving.protocol import ApplyRequest, PrefetchRequest

COMPLETION = {"prompt": "def add", "max_tokens": 2, "seed": 1, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(versions, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """One engine on a copy of the store that also holds a version signed by a stranger's key
    (``v9-foreign``) and an unsigned one (``v8-unsigned``)."""
    from policy.weights import SigningKey, WeightStore

    root = tmp_path_factory.mktemp("guarded")
    store = root / "store"
    shutil.copytree(versions.store, store)
    stranger = SigningKey(root / "stranger.pem", root / "stranger.pub")
    WeightStore(store, signer=stranger).put(versions.model_tensors["v1"], version="v9-foreign", parent="v0")
    WeightStore(store, signer=SigningKey(versions.signing_key)).put(
        versions.model_tensors["v2"], version="v8-unsigned", parent="v0"
    )
    manifest = store / "versions" / "v8-unsigned" / "manifest.json"
    doc = json.loads(manifest.read_text())
    del doc["signature"]
    manifest.write_text(json.dumps(doc))
    procs = versions.start_engines(1, root, store)
    yield procs[0]
    for p in procs:
        p.kill()


def _served(url: str) -> tuple[str, str, bool, str]:
    """(version, hash, paused, fingerprint of a completion answered within 30 s), read with the token."""
    headers = {"authorization": f"Bearer {CONTROL_TOKEN}"}
    rpc = httpx.post(url + "/collective_rpc", json={"method": "undertow_weight_info"}, headers=headers, timeout=30)
    info = rpc.json()["results"][0]
    paused = httpx.get(url + "/is_paused", headers=headers, timeout=30).json()["is_paused"]
    answer = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
    assert answer.status_code == 200, answer.text  # neither held by a pause nor refused by a sleep
    return info["version"], info["hash"], paused, answer.json()["system_fingerprint"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": CONTROL_TOKEN},
        {"authorization": f"Basic {CONTROL_TOKEN}"},
    ],
    ids=["none", "wrong", "no-scheme", "basic"],
)
def test_control_routes_refuse_a_missing_or_wrong_token_and_nothing_happens(guarded, versions, headers) -> None:  # type: ignore[no-untyped-def]
    url = guarded.url  # type: ignore[attr-defined]
    before = _served(url)
    assert before == ("v0", versions.hashes["v0"], False, "v0")
    calls = [
        ("POST", "/pause", {"params": {"wait_for_inflight_requests": "false"}}),
        ("POST", "/sleep", {"params": {"level": "1"}}),
        ("POST", "/collective_rpc", {"json": {"method": "undertow_prefetch", "kwargs": {"to_version": "v1"}}}),
        ("POST", "/collective_rpc", {"json": {"method": "undertow_apply", "kwargs": {"to_version": "v1"}}}),
        ("POST", "/collective_rpc", {"json": {"method": "undertow_weight_info"}}),
        ("POST", "/resume", {}),
        ("POST", "/wake_up", {}),
        ("GET", "/is_paused", {}),
        ("GET", "/is_sleeping", {}),
        ("POST", "/v1/load_lora_adapter", {"json": {"lora_name": "x", "lora_path": "/tmp"}}),  # a vLLM dev route
        ("GET", "/openapi.json", {}),
    ]
    for method, path, kwargs in calls:
        answer = httpx.request(method, url + path, headers=headers, timeout=30, **kwargs)  # type: ignore[arg-type]
        assert answer.status_code == 401, (path, answer.text)
        assert answer.json()["error"]["type"] == "AuthenticationError"
        assert answer.headers["www-authenticate"].startswith("Bearer")
    assert _served(url) == before  # not paused, not asleep, v0 with its hash, nothing staged

    async def deployer_without_token() -> None:
        async with EngineClient(url) as client:
            with pytest.raises(EngineError) as err:
                await client.pause(wait_for_inflight_requests=False)
            assert err.value.status == 401
            assert (await client.completions(COMPLETION)).system_fingerprint == "v0"  # inference needs no token

    asyncio.run(deployer_without_token())
    assert _served(url) == before


def test_inference_never_needs_the_token(guarded) -> None:  # type: ignore[no-untyped-def]
    url = guarded.url  # type: ignore[attr-defined]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "undertow-policy"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("version", "reason"),
    [("v9-foreign", "which this replica does not trust"), ("v8-unsigned", "is not signed")],
)
def test_a_foreign_or_unsigned_version_is_refused_and_the_weights_stay(guarded, versions, version, reason) -> None:  # type: ignore[no-untyped-def]
    url = guarded.url  # type: ignore[attr-defined]
    before = _served(url)

    async def go() -> None:
        async with EngineClient(url, token=CONTROL_TOKEN) as client:
            with pytest.raises(EngineError, match=reason) as err:
                await client.prefetch(PrefetchRequest(to_version=version, kind="snapshot"))
            assert err.value.status == 422 and f"refusing version '{version}'" in err.value.message
            assert (await client.weight_info()).staged is None
            await client.pause()
            try:
                with pytest.raises(EngineError, match="nothing staged"):
                    await client.apply(ApplyRequest(to_version=version, expected_hash=versions.hashes["v0"]))
            finally:
                await client.resume()

    asyncio.run(go())
    assert _served(url) == before
    # The same engine still takes a signed version, and goes back.
    assert _switch(url, versions, "v1")[0] == "v1" and _switch(url, versions, "v0")[0] == "v0"


def _switch(url: str, versions, to: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    async def go() -> tuple[str, str]:
        async with EngineClient(url, token=CONTROL_TOKEN) as client:
            _pulled, info = await pull_and_switch(client, versions, to)
            return info.version, info.hash

    return asyncio.run(go())


def test_vllms_server_gets_the_same_guard_from_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``vllm serve --middleware serving.engine_auth.ControlAuth``: vLLM adds the class with no arguments,
    and it reads the token the deployer sends from ``UNDERTOW_SERVING__FLEET__CONTROL_TOKEN``."""
    from fastapi import FastAPI, WebSocket, WebSocketDisconnect
    from fastapi.testclient import TestClient

    from serving.engine_auth import TOKEN_ENV, ControlAuth

    paused: list[bool] = []
    app = FastAPI()
    app.post("/pause")(lambda: paused.append(True))
    app.post("/v1/completions")(lambda: {"ok": True})

    async def realtime(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("open")
        await socket.close()

    app.router.add_websocket_route("/v1/realtime", realtime)  # vLLM's, neither inference over HTTP nor a probe

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    app.add_middleware(ControlAuth)
    with TestClient(app) as client:
        assert client.post("/pause").status_code == 401
        assert client.post("/pause", headers={"authorization": "Bearer s3cre"}).status_code == 401
        with pytest.raises(WebSocketDisconnect), client.websocket_connect("/v1/realtime"):
            pass
        assert paused == []
        assert client.post("/v1/completions").json() == {"ok": True}
        assert client.post("/pause", headers={"authorization": "bearer s3cret"}).status_code == 200
        assert paused == [True]
        with client.websocket_connect("/v1/realtime", headers={"authorization": "Bearer s3cret"}) as socket:
            assert socket.receive_text() == "open"
    monkeypatch.delenv(TOKEN_ENV)
    closed = FastAPI()
    closed.post("/pause")(lambda: paused.append(True))
    closed.add_middleware(ControlAuth)
    with TestClient(closed) as client:  # no token configured: closed, and the answer says what to set
        answer = client.post("/pause", headers={"authorization": "Bearer "})
        assert answer.status_code == 401 and TOKEN_ENV in answer.json()["error"]["message"]
    assert paused == [True]
