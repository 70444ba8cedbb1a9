"""What a replica's weight update holds between ``prefetch`` and ``apply``: per tensor the verified
target (whole, or sparse: changed positions and their new bits), and the sparse undo that reverts it.

Producer and consumer: :class:`serving.weights.WeightUpdater` (in the engine process, or in each
vLLM worker through :mod:`serving.vllm_ext`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from policy.weights.changes import Changes, materialize
from policy.weights.format import TensorMeta

UNDO_MAX_FRACTION = 0.5
"""Keep an update's undo (changed elements and their old values) while it is at most this share of the model."""
DENSE_WRITE_FRACTION = 0.5
"""Write a whole tensor instead of its changed positions when more than this share of it changed."""


@dataclass
class Update:
    """One tensor's staged update, verified against its target checksum: either the whole target
    tensor (``words``) or, sparse, the positions that change and their new bits (``values``)."""

    meta: TensorMeta
    """The target's dtype, shape and checksum."""
    words: np.ndarray | None
    """The whole target tensor's words (None for a sparse update)."""
    positions: np.ndarray | None
    """Sorted flat positions whose bits change (None: not known, the whole tensor is written)."""
    values: np.ndarray | None = None
    """The new words at ``positions`` (None: read them from ``words``)."""
    old: np.ndarray | None = None
    """The held words at ``positions`` when decoding read them (the undo's values)."""
    prepared: tuple[torch.Tensor, torch.Tensor] | None = None
    """Positions and values ready for :meth:`serving.params.LiveParams.scatter` (built before the pause)."""

    def target(self, held: np.ndarray) -> np.ndarray:
        """The whole target tensor (built from the held bits when sparse)."""
        if self.words is not None:
            return self.words
        assert self.positions is not None and self.values is not None
        return materialize(held, Changes("sparse", self.positions, self.values))

    def sparse(self) -> bool:
        """Whether to write the changed positions only (few enough of them, and known)."""
        if self.positions is None:
            return False
        return self.words is None or self.positions.size <= DENSE_WRITE_FRACTION * self.words.size

    def new_values(self) -> np.ndarray:
        assert self.positions is not None
        if self.values is None:
            assert self.words is not None
            self.values = self.words.take(self.positions)
        return self.values


@dataclass
class Undo:
    """The elements an update replaced, sparse: applying them returns to ``version``."""

    version: str
    table: dict[str, TensorMeta]
    """What the reverted tensors' checksums must be."""
    changes: dict[str, tuple[np.ndarray, np.ndarray]]
    """name -> (flat positions, old words at them)."""

    @property
    def nbytes(self) -> int:
        return sum(idx.nbytes + old.nbytes for idx, old in self.changes.values())


@dataclass
class Staged:
    """An update pulled, decoded and verified, waiting for ``apply``."""

    to_version: str
    base_version: str
    kind: str
    """``delta`` (a chain of deltas), ``snapshot`` or ``undo`` (revert of the last update)."""
    updates: dict[str, Update]
    nbytes: int
    steps: list[str] = field(default_factory=list)
    undo: Undo | None = None
    """How to revert this update (computed while pulling, kept after ``apply``)."""
