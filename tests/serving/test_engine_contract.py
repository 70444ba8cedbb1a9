"""The engine HTTP contract, over real HTTP against the CPU engine process, through the same
:class:`serving.client.EngineClient` the gateway and deployer use against vLLM."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from serving_helpers import CONTROL_TOKEN, pull_and_switch

from ingest.arrays import npy_from_b64
from serving.client import EngineClient, EngineError
from serving.protocol import ApplyRequest, PrefetchRequest


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_completion_carries_token_ids_logprobs_and_routed_experts(one_engine, versions) -> None:  # type: ignore[no-untyped-def]
    from policy.forward import score_tokens
    from policy.model import load_checkpoint

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient(one_engine.url, token=CONTROL_TOKEN) as c:
            return await c.completions(
                {
                    "prompt": "def add(a, b):",
                    "max_tokens": 6,
                    "n": 2,
                    "seed": 7,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
            )

    resp = run(go())
    assert resp.system_fingerprint == "v0" and len(resp.choices) == 2
    model, _ = load_checkpoint(versions.checkpoint)
    cfg = model.config
    for choice in resp.choices:
        assert choice.token_ids and choice.prompt_token_ids and choice.logprobs is not None
        assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)
        experts = npy_from_b64(choice.routed_experts or "")
        total = len(choice.prompt_token_ids) + len(choice.token_ids)
        assert experts.shape == (total - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        # The trainer's scoring pass reproduces the served logprobs and routing exactly.
        scored = score_tokens(
            model, choice.prompt_token_ids + choice.token_ids, prompt_len=len(choice.prompt_token_ids)
        )
        assert np.array_equal(np.asarray(scored.logprobs, dtype=np.float64), np.asarray(choice.logprobs.token_logprobs))
        assert np.array_equal(scored.routed_experts, experts)


def test_same_seed_same_tokens_and_token_id_prompts(one_engine) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "seed": 3, "return_token_ids": True, "temperature": 1.0}
    a = httpx.post(one_engine.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(one_engine.url + "/v1/completions", json=body, timeout=60).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["prompt_token_ids"] == [5, 6, 7]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": [999999]}, "out of range"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 1000}, "n 1000"),
        ({"prompt": "x", "stream": "sometimes"}, "stream"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "model": "other"}, "does not exist"),
    ],
)
def test_bad_requests_get_4xx_with_a_message(one_engine, body, needle) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(one_engine.url + "/v1/completions", json=body, timeout=30)
    assert 400 <= resp.status_code < 500
    assert needle in resp.json()["error"]["message"]


def test_models_health_sleep(one_engine) -> None:  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient(one_engine.url, token=CONTROL_TOKEN) as c:
            assert await c.health()
            assert await c.models() == ["undertow-policy"]
            await c.sleep(1)
            assert await c.is_sleeping()
            with pytest.raises(EngineError) as err:
                await c.completions({"prompt": "x", "max_tokens": 1})
            assert err.value.status == 503
            await c.wake_up()
            assert not await c.is_sleeping()
            with pytest.raises(EngineError, match="unknown method"):
                await c.rpc("reload_everything")

    run(go())


def test_pause_holds_requests_until_resume(one_engine) -> None:  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient(one_engine.url, token=CONTROL_TOKEN) as c:
            await c.pause()
            task = asyncio.create_task(c.completions({"prompt": "x", "max_tokens": 2}))
            await asyncio.sleep(0.8)
            assert not task.done(), "a request to a paused engine must be held, not answered"
            t0 = time.perf_counter()
            await c.resume()
            resp = await task
            assert resp.choices and time.perf_counter() - t0 < 30

    run(go())


def test_corrupt_or_wrong_update_is_refused_and_old_weights_keep_serving(one_engine, versions) -> None:  # type: ignore[no-untyped-def]
    delta = versions.store / "versions" / "v1" / "delta.bin"
    good = delta.read_bytes()

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient(one_engine.url, token=CONTROL_TOKEN) as c:
            before = await c.completions({"prompt": "def", "max_tokens": 4, "seed": 1, "temperature": 0})
            # Corrupt bytes (same size): a delta-only pull is refused before anything is staged...
            delta.write_bytes(good[: len(good) // 2] + bytes(64) + good[len(good) // 2 + 64 :])
            with pytest.raises(EngineError, match="corrupt"):
                await c.prefetch(PrefetchRequest(to_version="v1", from_version="v0", kind="delta"))
            assert (await c.weight_info()).staged is None
            # ...and an automatic pull routes around it to the verified snapshot.
            pulled = await c.prefetch(PrefetchRequest(to_version="v1", from_version="v0"))
            assert pulled["kind"] == "snapshot" and pulled["steps"] == ["full:v1"]
            await c.discard()
            # A valid delta with the wrong expected hash: refused at verification, nothing written.
            delta.write_bytes(good)
            pulled = await c.prefetch(PrefetchRequest(to_version="v1", from_version="v0", kind="delta"))
            assert pulled["kind"] == "delta" and pulled["steps"] == ["delta:v1"]
            await c.pause()
            with pytest.raises(EngineError, match="refused"):
                await c.apply(ApplyRequest(to_version="v1", expected_hash="0" * 64))
            await c.resume()
            info = await c.weight_info()
            assert (info.version, info.hash) == ("v0", versions.hashes["v0"])
            after = await c.completions({"prompt": "def", "max_tokens": 4, "seed": 1, "temperature": 0})
            assert after.choices[0].text == before.choices[0].text
            # Applying without a pause is refused (weights never change under a running request).
            await c.prefetch(PrefetchRequest(to_version="v1", from_version="v0"))
            with pytest.raises(EngineError) as err:
                await c.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
            assert err.value.status == 409
            # The real update switches; a two-delta chain, then back by the snapshot.
            await c.prefetch(PrefetchRequest(to_version="v1", from_version="v0"))
            await c.pause()
            info = await c.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
            await c.resume()
            assert (info.version, info.hash) == ("v1", versions.hashes["v1"])
            await c.prefetch(PrefetchRequest(to_version="v0", kind="snapshot"))
            await c.pause()
            info = await c.apply(ApplyRequest(to_version="v0", expected_hash=versions.hashes["v0"]))
            await c.resume()
            assert info.version == "v0"
            pulled, info = await pull_and_switch(c, versions, "v2", kind="delta")
            assert pulled["steps"] == ["delta:v1", "delta:v2"]
            assert (info.version, info.hash) == ("v2", versions.hashes["v2"])
            await c.prefetch(PrefetchRequest(to_version="v0", kind="snapshot"))
            await c.pause()
            await c.apply(ApplyRequest(to_version="v0", expected_hash=versions.hashes["v0"]))
            await c.resume()
            again = await c.completions({"prompt": "def", "max_tokens": 4, "seed": 1, "temperature": 0})
            assert again.choices[0].text == before.choices[0].text

    try:
        run(go())
    finally:
        delta.write_bytes(good)
