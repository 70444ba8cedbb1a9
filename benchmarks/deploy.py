"""Deployment benchmark: roll a new version to 3 CPU engine replicas under loopback load, with
deltas and with full snapshots (the baseline), and measure the gateway's overhead.

Fields: ``delta_rollout_s``, ``full_rollout_s``, ``speedup`` (full / delta), ``max_pause_ms``
(longest pause of a replica in the delta rollout), ``failed_requests`` (user requests through
the gateway that failed during both rollouts), ``gateway_overhead_ms_p50`` (p50 of gateway
minus direct latency for the same 1-token request). The version step touches a quarter of the
expert tensors and the attention of every layer, a small fraction of their entries each, as an
MoE optimizer step with few routed experts would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_store(root: Path) -> tuple[Path, Path, dict[str, str]]:
    from policy.model import build_model, save_checkpoint
    from policy.tokenizer import train_tokenizer
    from serving._devstore import DevStore

    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300)
    model = build_model("small", len(tok), 0)
    ckpt = save_checkpoint(model, tok, root / "ckpt")
    v0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    v1 = {}
    for name, t in v0.items():
        touched = "self_attn" in name or (".experts." in name and int(torch.randint(0, 4, (1,), generator=gen)) == 0)
        if touched:
            mask = torch.rand(t.shape, generator=gen) < 0.04
            t = t + mask * torch.randn(t.shape, generator=gen) * 1e-3
        v1[name] = t
    store = DevStore(root / "store")
    hashes = {"v0": store.publish_snapshot("v0", v0), "v1": store.publish_snapshot("v1", v1)}
    store.publish_delta(v0, v1, "v0", "v1")
    store.publish_delta(v1, v0, "v1", "v0")
    return ckpt, store.root, hashes


class Load:
    def __init__(self, url: str, workers: int) -> None:
        self.url, self.ok, self.failed, self.stop = url, 0, 0, threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(workers)]

    def run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                r = c.post(self.url + "/v1/completions", json={"prompt": "def add", "max_tokens": 4})
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--workers", type=int, default=3, help="concurrent load clients")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from ingest.db import make_engine, upgrade
    from serving import fleet
    from serving.config import DeployConfig, FleetConfig, GatewayConfig
    from serving.deploy import rollout
    from serving.gateway import Gateway, create_gateway_app, registry_source
    from serving.launch import start_engines

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "serving"))
    from serving_helpers import ServerThread

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt, store, hashes = make_store(root)
        procs = start_engines(ckpt, 3, store=store)
        try:
            url = f"sqlite:///{root / 'db.sqlite'}"
            upgrade(url)
            db = make_engine(url)
            fcfg = FleetConfig(unhealthy_after=1)
            for i, p in enumerate(procs):
                fleet.register_replica(db, f"r{i}", p.url)
            fleet.set_target(db, "v0", hashes["v0"])
            asyncio.run(fleet.check_fleet(db, fcfg))
            gw = Gateway(registry_source(db, "default", 0.2), None, GatewayConfig(), "undertow-policy")
            cfg = DeployConfig(canary_replicas=1, stages=[0.5, 1.0])
            with ServerThread(create_gateway_app(gw)) as srv:
                # Gateway overhead: the same 1-token request direct and through the gateway.
                body = {"prompt": "def", "max_tokens": 1, "temperature": 0}
                direct, via = [], []
                with httpx.Client(timeout=60) as c:
                    for _ in range(30):
                        t0 = time.perf_counter()
                        c.post(procs[0].url + "/v1/completions", json=body)
                        direct.append((time.perf_counter() - t0) * 1000)
                        t0 = time.perf_counter()
                        c.post(srv.url + "/v1/completions", json=body)
                        via.append((time.perf_counter() - t0) * 1000)
                overhead = statistics.median(via) - statistics.median(direct)
                with Load(srv.url, args.workers) as load:
                    time.sleep(0.5)
                    delta = asyncio.run(rollout(db, "v1", hashes["v1"], cfg, kind="delta"))
                    full = asyncio.run(rollout(db, "v0", hashes["v0"], cfg, kind="snapshot"))
                    time.sleep(0.3)
        finally:
            for p in procs:
                p.kill()
    result = {
        "delta_rollout_s": round(delta.seconds, 3),
        "full_rollout_s": round(full.seconds, 3),
        "speedup": round(full.seconds / delta.seconds, 2),
        "max_pause_ms": round(max(delta.pause_ms.values()), 1),
        "max_pause_ms_full": round(max(full.pause_ms.values()), 1),
        "delta_bytes_per_replica": max(delta.pulled_bytes.values()),
        "snapshot_bytes_per_replica": max(full.pulled_bytes.values()),
        "failed_requests": load.failed,
        "served_requests": load.ok,
        "gateway_overhead_ms_p50": round(overhead, 2),
        "statuses": [delta.status, full.status],
        "note": "3 CPU engine replicas on a shared 2-core machine under concurrent load; numbers are noisy",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
