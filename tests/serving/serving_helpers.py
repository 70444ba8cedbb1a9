"""Build a tiny policy checkpoint and a weight store with a few signed versions (what training would
publish), and read back the telemetry a test gateway sent."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONTROL_TOKEN = "test-engine-control-" + uuid.uuid4().hex
"""The control token of the engines the serving tests start (and what their clients send)."""


@dataclass
class Versions:
    checkpoint: Path
    store: Path
    hashes: dict[str, str]
    model_tensors: dict[str, dict[str, torch.Tensor]]
    """Each version's tensors as the store holds them (checkpoint names, bf16)."""
    signing_key: Path
    """The key the versions are signed with (the trainer's)."""
    public_key: Path
    """Its public key: what replicas verify the versions with."""

    def start_engines(self, n: int, log_dir: Path, store: Path | None = None) -> list[Any]:
        """``n`` CPU engine processes serving v0 from this store (or ``store``), verifying what they pull with
        its public key, their control routes answering ``CONTROL_TOKEN``."""
        from serving.launch import start_engines

        return start_engines(
            self.checkpoint,
            n,
            store=store or self.store,
            log_dir=log_dir,
            control_token=CONTROL_TOKEN,
            public_key=self.public_key,
        )

    def env(self) -> dict[str, str]:
        """Settings for processes that publish to this store or pull from it: its keys and the control token."""
        return {
            "UNDERTOW_POLICY__WEIGHTS__SIGNING_KEY": str(self.signing_key),
            "UNDERTOW_POLICY__WEIGHTS__PUBLIC_KEY": str(self.public_key),
            "UNDERTOW_SERVING__FLEET__CONTROL_TOKEN": CONTROL_TOKEN,
        }


def step(tensors: dict[str, torch.Tensor], seed: int, frac: float = 0.04) -> dict[str, torch.Tensor]:
    """A training-step-like change: a small fraction of entries moves (in fp32, stored in bf16)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        t = t.float()
        mask = torch.rand(t.shape, generator=gen) < frac
        out[name] = t + mask * t.abs().clamp_min(1e-3) * 0.05 * torch.randn(t.shape, generator=gen)
    return out


def make_versions(root: Path, preset: str = "tiny", n_versions: int = 3) -> Versions:
    """A checkpoint whose fp32 weights are bf16 values (v0), and a store with v0..v{n-1}: each a
    delta from its parent and a full snapshot, signed with a key made under ``root/keys``."""
    from safetensors.torch import load_file

    from policy.model import build_model, save_checkpoint
    from policy.tokenizer import train_tokenizer
    from policy.weights import SigningKey, WeightStore

    tok = train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in range(10):\n    print(x)\n"] * 20, 300)
    model = build_model(preset, len(tok), 0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ckpt = save_checkpoint(model, tok, root / "ckpt-v0")
    signer = SigningKey(root / "keys" / "signing.pem", root / "keys" / "signing.pub")
    store = WeightStore(root / "store", signer=signer)
    hashes = {"v0": store.put(ckpt, version="v0", full=True).version_hash}
    current = load_file(str(ckpt / "model.safetensors"))
    for i in range(1, n_versions):
        current = step(current, seed=i)
        hashes[f"v{i}"] = store.put(current, version=f"v{i}", full=True).version_hash
    tensors = {v: store.state_dict(v) for v in hashes}
    return Versions(ckpt, root / "store", hashes, tensors, signer.path, root / "keys" / "signing.pub")


async def pull_and_switch(client: Any, versions: Versions, to_version: str, kind: str = "auto") -> tuple[dict, Any]:
    """Prefetch ``to_version`` on a replica, then pause, apply with its expected hash and resume.

    Returns the prefetch answer and the apply result (:class:`serving.protocol.ApplyResult`)."""
    from serving.protocol import ApplyRequest, PrefetchRequest

    pulled = await client.prefetch(PrefetchRequest(to_version=to_version, kind=kind))
    await client.pause()
    try:
        info = await client.apply(ApplyRequest(to_version=to_version, expected_hash=versions.hashes[to_version]))
    finally:
        await client.resume()
    return pulled, info


def consume(bootstrap: str, topic: str, n: int, timeout_s: float = 30.0) -> list[dict]:  # type: ignore[type-arg]
    """Every event on ``topic`` (2 partitions) from the beginning, until ``n`` or the timeout."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1000)
    parts = [TopicPartition(topic, p) for p in range(2)]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    out: list[dict] = []  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            out.extend(json.loads(r.value) for r in batch)
    consumer.close()
    return out


@contextmanager
def telemetry_gateway(
    engine_url: str | list[str], bootstrap: str, spool: Path, prefix: str
) -> Iterator[tuple[str, str, Any]]:
    """A gateway (no keys) in front of one engine (or several) whose telemetry goes to a fresh topic on
    the broker; yields its URL, the topic and the :class:`serving.gateway.Gateway`."""
    from ingest.embedded import create_topics
    from ingest.producer import TelemetryProducer
    from serving.config import GatewayConfig
    from serving.gateway import Gateway, create_gateway_app, static_replicas
    from serving.launch import ServerThread
    from serving.telemetry import TelemetryEmitter

    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, {topic: 2})
    emitter = TelemetryEmitter(
        lambda: TelemetryProducer(bootstrap, topic, max_block_ms=2000, request_timeout_ms=3000),
        spool,
        retry_interval_s=0.3,
    )
    gateway = Gateway(
        static_replicas([engine_url] if isinstance(engine_url, str) else engine_url, "v0"),
        emitter,
        GatewayConfig(max_prompt_chars=4000),
        "undertow-policy",
    )
    with ServerThread(create_gateway_app(gateway)) as srv:
        yield srv.url, topic, gateway
