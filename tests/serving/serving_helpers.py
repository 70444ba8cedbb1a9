"""Build a tiny policy checkpoint and a weight store with a few versions (what training would publish)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Versions:
    checkpoint: Path
    store: Path
    hashes: dict[str, str]
    model_tensors: dict[str, dict[str, torch.Tensor]]


def step(tensors: dict[str, torch.Tensor], seed: int, frac: float = 0.04) -> dict[str, torch.Tensor]:
    """A training-step-like change: a small fraction of entries moves by a tiny amount."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        mask = torch.rand(t.shape, generator=gen) < frac
        out[name] = t + mask * torch.randn(t.shape, generator=gen) * 1e-3
    return out


def make_versions(root: Path, preset: str = "tiny", n_versions: int = 3) -> Versions:
    from policy.model import build_model, save_checkpoint
    from policy.tokenizer import train_tokenizer
    from serving._devstore import DevStore

    tok = train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in range(10):\n    print(x)\n"] * 20, 300)
    model = build_model(preset, len(tok), 0)
    ckpt = save_checkpoint(model, tok, root / "ckpt-v0")
    store = DevStore(root / "store")
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    all_t = {"v0": tensors}
    hashes = {"v0": store.publish_snapshot("v0", tensors)}
    for i in range(1, n_versions):
        prev, name = f"v{i - 1}", f"v{i}"
        all_t[name] = step(all_t[prev], seed=i)
        hashes[name] = store.publish_snapshot(name, all_t[name])
        store.publish_delta(all_t[prev], all_t[name], prev, name)
        store.publish_delta(all_t[name], all_t[prev], name, prev)
    return Versions(ckpt, store.root, hashes, all_t)


class ServerThread:
    """A uvicorn server for an ASGI app in a background thread on a free loopback port."""

    def __init__(self, app: object) -> None:
        import threading

        import uvicorn

        from ingest.embedded import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        import time

        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
