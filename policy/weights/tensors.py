"""Streaming tensor I/O: safetensors read and written tensor by tensor over any fsspec filesystem.

Memory stays bounded by the largest tensor: the header is parsed once, each tensor is a range
read; writing lays out the header from names, dtypes and shapes first, then streams the data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import fsspec
import numpy as np
import torch

from policy.weights.format import FROM_SAFETENSORS, SAFETENSORS_DTYPES, WeightsError, dtype_name, from_words, word_dtype

_MAX_HEADER = 100 << 20


class TensorSource(Protocol):
    """Anything that yields a version's tensors one at a time."""

    def names(self) -> list[str]:
        """Tensor names, in storage order."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """One tensor (CPU)."""
        ...


class DictSource:
    """A state dict as a :class:`TensorSource`."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state

    def names(self) -> list[str]:
        return list(self.state)

    def get(self, name: str) -> torch.Tensor:
        return self.state[name].detach().to("cpu")


class SafetensorsSource:
    """One or more safetensors files (a Hugging Face checkpoint directory, sharded or not)."""

    def __init__(self, files: Iterable[str], fs: fsspec.AbstractFileSystem | None = None):
        self.fs = fs or fsspec.filesystem("file")
        self.index: dict[str, tuple[str, str, list[int], int, int]] = {}
        for file in files:
            for name, (dtype, shape, start, end) in read_header(self.fs, file).items():
                if name in self.index:
                    raise WeightsError(f"tensor {name} appears in two checkpoint files; the checkpoint is malformed")
                self.index[name] = (file, dtype, shape, start, end)

    def names(self) -> list[str]:
        return list(self.index)

    def get(self, name: str) -> torch.Tensor:
        file, dtype, shape, start, end = self.index[name]
        with self.fs.open(file, "rb") as handle:
            handle.seek(start)
            data = handle.read(end - start)
        if len(data) != end - start:
            raise WeightsError(f"{file} is truncated: tensor {name} wants {end - start} bytes, got {len(data)}")
        words = np.frombuffer(data, dtype=word_dtype(dtype).newbyteorder("<")).astype(word_dtype(dtype), copy=True)
        return from_words(words, dtype, shape)


def checkpoint_files(directory: str | Path) -> list[str]:
    """The safetensors files of a Hugging Face checkpoint directory (``model.safetensors`` or shards)."""
    path = Path(directory)
    if path.is_file():
        return [str(path)]
    single = path / "model.safetensors"
    if single.exists():
        return [str(single)]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [str(path / shard) for shard in shards]
    raise WeightsError(
        f"{path} holds no model.safetensors or model.safetensors.index.json; pass a checkpoint directory"
    )


def read_header(fs: fsspec.AbstractFileSystem, file: str) -> dict[str, tuple[str, list[int], int, int]]:
    """Parse a safetensors header: name -> (dtype, shape, absolute start, absolute end)."""
    size = fs.size(file)
    with fs.open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise WeightsError(f"{file} is truncated: no safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER or 8 + length > size:
            raise WeightsError(f"{file} has a safetensors header of {length} bytes, larger than the file allows")
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise WeightsError(f"{file} has a corrupt safetensors header: {err}") from err
    out: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = FROM_SAFETENSORS.get(info.get("dtype"))
        if dtype is None:
            raise WeightsError(f"{file}: tensor {name} has unsupported dtype {info.get('dtype')}")
        start, end = (8 + length + int(o) for o in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        if end > size or end - start != int(np.prod(shape, dtype=np.int64)) * word_dtype(dtype).itemsize:
            raise WeightsError(f"{file} is truncated or corrupt at tensor {name}")
        out[name] = (dtype, shape, start, end)
    return out


def write_safetensors(
    fs: fsspec.AbstractFileSystem,
    file: str,
    metas: Mapping[str, tuple[str, list[int]]],
    tensor: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Stream a safetensors file: ``metas`` is name -> (dtype, shape), ``tensor(name)`` its words. Returns bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, (dtype, shape) in metas.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * word_dtype(dtype).itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with fs.open(file, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        for name, (dtype, _shape) in metas.items():
            words = tensor(name)
            if words.dtype != word_dtype(dtype):
                raise WeightsError(f"tensor {name} changed dtype while being written")
            handle.write(words.astype(words.dtype.newbyteorder("<"), copy=False).tobytes())
    return 8 + len(raw) + offset


def source_from(obj: TensorSource | Mapping[str, torch.Tensor] | str | Path) -> TensorSource:
    """A state dict, a checkpoint directory or safetensors file path, or a ready source."""
    if isinstance(obj, str | Path):
        return SafetensorsSource(checkpoint_files(obj))
    if isinstance(obj, Mapping):
        return DictSource(obj)
    return obj


def iter_tensors(source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one at a time."""
    for name in source.names():
        yield name, source.get(name)


def cast_for_serving(tensor: torch.Tensor, serving_dtype: str | None) -> torch.Tensor:
    """fp32/fp64 tensors (master weights) in the serving dtype; bf16, fp16, fp8 and integers unchanged."""
    if serving_dtype and tensor.dtype in (torch.float32, torch.float64) and dtype_name(tensor.dtype) != serving_dtype:
        return tensor.to(getattr(torch, serving_dtype))
    return tensor
