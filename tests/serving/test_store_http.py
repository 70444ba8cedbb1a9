"""The weight store over HTTP (``undertow weights serve``): a replica pulls deltas and snapshots
from it like from a directory, and the server is read-only, stays inside its root and serves
byte ranges; tampered or missing files are refused by the reader, not trusted."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from serving_helpers import CONTROL_TOKEN, pull_and_switch

from serving.launch import ServerThread
from serving.params import ModelParams
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.store_server import create_store_app
from serving.weights import WeightUpdater


def test_a_replica_pulls_deltas_and_snapshots_over_http(versions) -> None:  # type: ignore[no-untyped-def]
    from policy.model import load_checkpoint
    from policy.weights import WeightStore

    model, _ = load_checkpoint(versions.checkpoint)
    params = ModelParams(model, versions.checkpoint, threading.Lock())
    with ServerThread(create_store_app(versions.store)) as srv:
        url = srv.url + "/"
        remote, local = WeightStore(url), WeightStore(versions.store)
        assert [h.version for h in remote.heads()] == [h.version for h in local.heads()] == ["v0", "v1", "v2"]
        assert remote.manifest("v2").version_hash == versions.hashes["v2"]

        updater = WeightUpdater(params, version="v0", store_url=url, public_key=versions.public_key)
        assert updater.hash == versions.hashes["v0"]
        pulled = updater.prefetch(PrefetchRequest(to_version="v2", kind="delta"))
        assert pulled["steps"] == ["delta:v1", "delta:v2"]
        assert updater.apply(ApplyRequest(to_version="v2", expected_hash=versions.hashes["v2"])).version == "v2"
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, versions.model_tensors["v2"][q].float())

        assert updater.prefetch(PrefetchRequest(to_version="v1", kind="snapshot"))["steps"] == ["full:v1"]
        updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
        assert updater.hash == versions.hashes["v1"]


def test_the_store_server_is_read_only_and_stays_inside_its_root(versions) -> None:  # type: ignore[no-untyped-def]
    manifest = (versions.store / "versions" / "v1" / "manifest.json").read_bytes()
    with ServerThread(create_store_app(versions.store)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/-/health").json() == {"status": "ok", "versions": 3}
        listing = c.get("/versions/").text
        assert all(f'href="{v}/"' in listing for v in ("v0", "v1", "v2"))
        head = c.head("/versions/v1/manifest.json")
        assert head.status_code == 200 and int(head.headers["content-length"]) == len(manifest)
        part = c.get("/versions/v1/manifest.json", headers={"Range": "bytes=3-9"})
        assert part.status_code == 206 and part.content == manifest[3:10]
        for method in ("POST", "PUT", "DELETE"):
            assert c.request(method, "/versions/v1/manifest.json", content=b"{}").status_code == 405
        assert (versions.store / "versions" / "v1" / "manifest.json").read_bytes() == manifest
        for hostile in ("/../conftest.py", "/versions/%2e%2e/%2e%2e/x", "/versions/v1/../../../etc/passwd"):
            assert c.get(hostile).status_code == 404, hostile
        assert c.get("/versions/v1/").status_code == 404  # no listing but the versions


def test_the_store_server_hides_versions_without_a_manifest_and_serves_only_artifacts(  # type: ignore[no-untyped-def]
    versions, tmp_path: Path
) -> None:
    from policy.weights import WeightStore

    store = tmp_path / "store"
    shutil.copytree(versions.store, store)
    writing = store / "versions" / "v3"  # a write in progress: artifacts there, the manifest not yet
    writing.mkdir()
    shutil.copy(store / "versions" / "v2" / "delta.bin", writing / "delta.bin")
    (writing / "manifest.json.0123.tmp").write_bytes(b"{}")
    (store / "signing.pem").write_bytes(b"a file that is no artifact")
    (store / "versions" / "v1" / "notes.txt").write_bytes(b"neither is this")
    with ServerThread(create_store_app(store)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/-/health").json()["versions"] == 3
        assert 'href="v3/"' not in c.get("/versions/").text
        for hidden in (
            "/versions/v3/delta.bin",
            "/versions/v3/manifest.json",
            "/versions/v3/manifest.json.0123.tmp",
            "/signing.pem",
            "/versions/v1/notes.txt",
            "/versions/v1/delta.bin/x",
        ):
            assert c.get(hidden).status_code == 404, hidden
            assert c.head(hidden).status_code == 404, hidden
        assert c.get("/versions/v1/delta.bin").content == (store / "versions" / "v1" / "delta.bin").read_bytes()
        assert WeightStore(srv.url + "/").version_ids() == ["v0", "v1", "v2"]
        shutil.copy(store / "versions" / "v2" / "manifest.json", writing / "manifest.json")  # the write completes
        assert 'href="v3/"' in c.get("/versions/").text
        assert c.get("/versions/v3/delta.bin").status_code == 200


def test_tampered_or_missing_files_over_http_are_refused(versions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from policy.model import load_checkpoint
    from policy.weights import WeightsError, WeightStore

    store = tmp_path / "store"
    shutil.copytree(versions.store, store)
    delta = store / "versions" / "v1" / "delta.bin"
    raw = bytearray(delta.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    delta.write_bytes(bytes(raw))
    model, _ = load_checkpoint(versions.checkpoint)
    params = ModelParams(model, versions.checkpoint, threading.Lock())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ServerThread(create_store_app(store)) as srv:
        with pytest.raises(WeightsError, match="is not in the store"):
            WeightStore(srv.url + "/").manifest("v9")
        updater = WeightUpdater(params, version="v0", store_url=srv.url + "/", public_key=versions.public_key)
        with pytest.raises(ValueError, match="delta of v1 is corrupt"):
            updater.prefetch(PrefetchRequest(to_version="v1", kind="delta"))
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        # The snapshot path around the bad delta still gets the exact bits.
        assert updater.prefetch(PrefetchRequest(to_version="v1"))["steps"] == ["full:v1"]
        updater.apply(ApplyRequest(to_version="v1", expected_hash=versions.hashes["v1"]))
        assert updater.hash == versions.hashes["v1"]


def test_planning_over_http_reads_each_version_once_and_sees_versions_come_and_go(  # type: ignore[no-untyped-def]
    versions, tmp_path: Path
) -> None:
    from policy.weights import WeightStore

    store = tmp_path / "store"
    shutil.copytree(versions.store, store)
    (store / "versions" / "v3").mkdir()  # a write in progress: no manifest yet
    with ServerThread(create_store_app(store)) as srv:
        remote = WeightStore(srv.url + "/")
        assert [h.version for h in remote.heads()] == ["v0", "v1", "v2"]
        reads: list[str] = []
        real_open = remote.fs.open

        def counting_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            reads.append(str(path))
            return real_open(path, *args, **kwargs)

        remote.fs.open = counting_open  # type: ignore[method-assign]
        assert [h.version for h in remote.heads()] == ["v0", "v1", "v2"]
        assert reads == []  # each complete version read once; the incomplete one is not even listed
        shutil.copy(store / "versions" / "v2" / "manifest.json", store / "versions" / "v3" / "manifest.json")
        shutil.rmtree(store / "versions" / "v0")
        # v3's manifest names v2 (the copy): the head is read, its id checked, and it is skipped.
        assert [h.version for h in remote.heads()] == ["v1", "v2"]


def test_a_directory_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a weight store"):
        create_store_app(tmp_path)


def test_an_engine_process_serves_and_updates_from_an_http_store(versions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from serving.client import EngineClient
    from serving.launch import EngineProcess

    with ServerThread(create_store_app(versions.store)) as srv:
        engine = EngineProcess(
            versions.checkpoint,
            "v0",
            srv.url + "/",
            log_path=tmp_path / "engine.log",
            control_token=CONTROL_TOKEN,
            public_key=versions.public_key,
        ).start()
        try:
            engine.wait_ready(timeout_s=180)

            async def go() -> None:
                async with EngineClient(engine.url, token=CONTROL_TOKEN) as c:
                    info = await c.weight_info()
                    assert (info.version, info.hash) == ("v0", versions.hashes["v0"])
                    pulled, info = await pull_and_switch(c, versions, "v2", kind="delta")
                    assert pulled["steps"] == ["delta:v1", "delta:v2"]
                    assert (info.version, info.hash) == ("v2", versions.hashes["v2"])
                    assert (await c.completions({"prompt": "def", "max_tokens": 2})).choices

            asyncio.run(go())
        finally:
            engine.kill()
