"""Interim weight store used until ``policy.weights`` lands (XOR deltas + zstd, per-tensor sha256).

Layout: ``<root>/versions/<v>/model.safetensors``, ``<root>/versions/<v>/HASH``,
``<root>/deltas/<from>__<to>.delta`` (a safetensors file of uint8 XOR streams, zstd-compressed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors.torch import load, load_file, save, save_file


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def combine(digests: dict[str, str]) -> str:
    """The version hash from per-tensor digests (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]}\n".encode())
    return h.hexdigest()


def state_hash(tensors: dict[str, torch.Tensor]) -> str:
    return combine({k: tensor_digest(v) for k, v in tensors.items()})


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).numpy().reshape(-1)


class DevStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def publish_snapshot(self, version: str, tensors: dict[str, torch.Tensor]) -> str:
        d = self.root / "versions" / version
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        digest = state_hash(tensors)
        (d / "HASH").write_text(digest)
        return digest

    def publish_delta(self, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], from_v: str, to_v: str) -> int:
        parts = {}
        for name, t in new.items():
            x = np.bitwise_xor(_bytes(base[name]), _bytes(t))
            if x.any():
                parts[name] = torch.from_numpy(x.copy())
        raw = zstandard.ZstdCompressor(level=3).compress(save(parts))
        path = self.root / "deltas" / f"{from_v}__{to_v}.delta"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        return len(raw)

    def version_hash(self, version: str) -> str:
        return (self.root / "versions" / version / "HASH").read_text().strip()

    def has_delta(self, from_v: str, to_v: str) -> bool:
        return (self.root / "deltas" / f"{from_v}__{to_v}.delta").exists()

    def read_delta(self, from_v: str, to_v: str) -> bytes:
        return (self.root / "deltas" / f"{from_v}__{to_v}.delta").read_bytes()

    def read_snapshot(self, version: str) -> dict[str, torch.Tensor]:
        return load_file(self.root / "versions" / version / "model.safetensors")


def decode_delta(raw: bytes, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New tensors for the names the delta touches (``live`` is read, not written)."""
    parts = load(zstandard.ZstdDecompressor().decompress(raw))
    out = {}
    for name, xor in parts.items():
        base = live[name]
        flat = np.bitwise_xor(_bytes(base), xor.numpy())
        out[name] = torch.from_numpy(flat.copy()).view(base.dtype).reshape(base.shape)
    return out


def snapshot_bytes(store: DevStore, version: str) -> int:
    return (store.root / "versions" / version / "model.safetensors").stat().st_size


def cheapest_path(store: DevStore, from_v: str, to_v: str) -> list[tuple[str, str]] | None:
    """The chain of deltas with the fewest bytes from ``from_v`` to ``to_v`` (Dijkstra), or None."""
    import heapq

    edges: dict[str, list[tuple[str, int]]] = {}
    for path in (store.root / "deltas").glob("*.delta"):
        a, b = path.stem.split("__", 1)
        edges.setdefault(a, []).append((b, path.stat().st_size))
    best = {from_v: 0}
    prev: dict[str, str] = {}
    heap = [(0, from_v)]
    while heap:
        cost, node = heapq.heappop(heap)
        if node == to_v:
            chain = [node]
            while chain[-1] != from_v:
                chain.append(prev[chain[-1]])
            chain.reverse()
            return list(zip(chain, chain[1:], strict=False))
        if cost > best.get(node, 1 << 62):
            continue
        for nxt, size in edges.get(node, []):
            if cost + size < best.get(nxt, 1 << 62):
                best[nxt], prev[nxt] = cost + size, node
                heapq.heappush(heap, (cost + size, nxt))
    return None


def path_bytes(store: DevStore, chain: list[tuple[str, str]]) -> int:
    return sum((store.root / "deltas" / f"{a}__{b}.delta").stat().st_size for a, b in chain)
