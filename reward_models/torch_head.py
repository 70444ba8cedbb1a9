"""The torch reward head: the second backend, for scale (GPUs, larger hidden layers, more data).

``r(x) = v . relu(EmbeddingBag(x) + b) + u . x_num + c``: an embedding bag over the hashed
n-gram columns (weighted by their feature values), a ReLU hidden layer, and a linear part over
the numeric columns. Trained with Adam in minibatches on the same sparse features as the
scikit-learn backend; pairwise with the Bradley-Terry loss (with margin), pointwise with BCE.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
from torch import nn

from reward_models.config import RewardsConfig
from reward_models.features import NUMERIC, Featurizer
from reward_models.losses import bradley_terry_loss, pointwise_loss

_BATCH = 1024


class RewardNet(nn.Module):
    """Embedding bag over hashed columns plus a linear numeric part, one scalar out."""

    def __init__(self, n_hashed: int, n_numeric: int, dim: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(n_hashed, dim, mode="sum", sparse=True)
        self.bias = nn.Parameter(torch.zeros(dim))
        self.out = nn.Linear(dim, 1)
        self.numeric = nn.Linear(n_numeric, 1, bias=False)
        nn.init.normal_(self.bag.weight, std=0.01)

    def forward(
        self, idx: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor, num: torch.Tensor
    ) -> torch.Tensor:
        hidden = torch.relu(self.bag(idx, offsets, per_sample_weights=weights) + self.bias)
        return (self.out(hidden) + self.numeric(num)).squeeze(-1)


def _batch(features: sp.csr_matrix, rows: np.ndarray, n_hashed: int) -> tuple[torch.Tensor, ...]:
    """EmbeddingBag inputs of ``rows``: hashed column ids, bag offsets, values, numeric block."""
    sub = features[rows]
    hashed = sub[:, :n_hashed].tocsr()
    num = np.asarray(sub[:, n_hashed:].todense(), dtype=np.float32)
    return (
        torch.from_numpy(hashed.indices.astype(np.int64)),
        torch.from_numpy(hashed.indptr[:-1].astype(np.int64)),
        torch.from_numpy(hashed.data.astype(np.float32)),
        torch.from_numpy(num),
    )


class _TorchBase:
    def __init__(self, config: RewardsConfig) -> None:
        self.config = config
        self.featurizer = Featurizer(config.hash_features)
        self.net = RewardNet(config.hash_features, len(NUMERIC), config.torch_dim)

    def _scores(self, features: sp.csr_matrix, rows: np.ndarray) -> torch.Tensor:
        return self.net(*_batch(features, rows, self.config.hash_features))

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        features = self.featurizer.transform(frame)
        out = []
        self.net.eval()
        with torch.no_grad():
            for start in range(0, features.shape[0], 8 * _BATCH):
                rows = np.arange(start, min(start + 8 * _BATCH, features.shape[0]))
                out.append(self._scores(features, rows).numpy().astype(np.float64))
        return np.concatenate(out) if out else np.zeros(0)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """SparseAdam for the embedding bag (only touched rows update), Adam with weight decay for the rest."""
        dense = [p for n, p in self.net.named_parameters() if not n.startswith("bag.")]
        return [
            torch.optim.SparseAdam(list(self.net.bag.parameters()), lr=0.01),
            torch.optim.Adam(dense, lr=0.01, weight_decay=self.config.l2),
        ]

    def _step(self, optimizers: list[torch.optim.Optimizer], loss: torch.Tensor) -> None:
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()


def batch_size(n: int) -> int:
    """Minibatch size: about 16 steps per epoch on small data, at most ``_BATCH`` rows."""
    return int(min(_BATCH, max(32, n // 16)))


class TorchPointwise(_TorchBase):
    """Keep/accept head trained with binary cross-entropy."""

    def fit(self, frame: pd.DataFrame, y: np.ndarray, weight: np.ndarray | None = None) -> TorchPointwise:
        torch.manual_seed(self.config.seed)
        features = self.featurizer.fit(frame).transform(frame)
        target = torch.from_numpy(np.asarray(y, dtype=np.float32))
        w = torch.from_numpy(np.ones(len(y), np.float32) if weight is None else weight.astype(np.float32))
        opts = self._optimizers()
        rng = np.random.default_rng(self.config.seed)
        size = batch_size(len(y))
        self.net.train()
        for _ in range(self.config.torch_epochs):
            order = rng.permutation(len(y))
            for start in range(0, len(order), size):
                rows = order[start : start + size]
                self._step(opts, pointwise_loss(self._scores(features, rows), target[rows], w[rows]))
        return self


class TorchPairwise(_TorchBase):
    """Bradley-Terry head: ``-log sigmoid(r_c - r_r - margin)`` over selection pairs."""

    def fit(self, frame: pd.DataFrame, chosen: np.ndarray, rejected: np.ndarray, weight: np.ndarray) -> TorchPairwise:
        torch.manual_seed(self.config.seed)
        features = self.featurizer.fit(frame).transform(frame)
        w = torch.from_numpy(weight.astype(np.float32))
        opts = self._optimizers()
        rng = np.random.default_rng(self.config.seed)
        size = batch_size(len(chosen))
        self.net.train()
        for _ in range(self.config.torch_epochs):
            order = rng.permutation(len(chosen))
            for start in range(0, len(order), size):
                sel = order[start : start + size]
                r_c = self._scores(features, chosen[sel])
                r_r = self._scores(features, rejected[sel])
                self._step(opts, bradley_terry_loss(r_c, r_r, self.config.bt_margin, w[sel]))
        return self
