"""Session features for the reward models: hashed text n-grams plus a few numeric columns.

Text: whitespace tokens of the prompt and of the completion (separate hash namespaces), as
unigrams and bigrams hashed into ``n_features`` columns (the hashing trick: no vocabulary to
store, constant memory; Weinberger et al., "Feature Hashing for Large Scale Multitask
Learning", ICML 2009). Each row is scaled by ``1/sqrt(tokens)`` so long texts do not dominate.
Hashing is vectorized (one pass of ``pandas.util.hash_array`` over all tokens), several times
faster than a per-document regex tokenizer; the price is that ``a+b`` is one token.

Numeric (standardized with the training mean and deviation): log lengths of completion and
prompt in characters, lines and tokens, the edit statistics (lines added and removed), and the
policy's own mean logprob with a missing indicator (NaN logprobs are imputed, never fed raw).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.base import BaseEstimator, TransformerMixin

NUMERIC = [
    "log_chars",
    "log_lines",
    "log_tokens",
    "log_prompt_chars",
    "log_added",
    "log_removed",
    "mean_logprob",
    "logprob_missing",
]
_PROMPT_SALT = np.uint64(0x9E3779B97F4A7C15)
_BIGRAM_MUL = np.uint64(1000003)


def _tokens(texts: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Flat array of whitespace tokens and the number per document."""
    # ``tolist`` first: iterating a pandas string array item by item costs more than the split.
    split = [str(t).split() for t in texts.tolist()]
    lens = np.fromiter(map(len, split), dtype=np.int64, count=len(split))
    flat = np.fromiter(itertools.chain.from_iterable(split), dtype=object, count=int(lens.sum()))
    return flat, lens


def hash_ngrams(texts: pd.Series, n_features: int, salt: np.uint64 = np.uint64(0)) -> sp.csr_matrix:
    """CSR matrix of unigram and bigram counts of ``texts`` hashed into ``n_features`` columns."""
    n = len(texts)
    flat, lens = _tokens(texts)
    if flat.size == 0:
        return sp.csr_matrix((n, n_features), dtype=np.float32)
    uni = pd.util.hash_array(flat, categorize=True) ^ salt
    rows = np.repeat(np.arange(n, dtype=np.int64), lens)
    same = rows[1:] == rows[:-1]
    bi = (uni[:-1] * _BIGRAM_MUL ^ uni[1:])[same]
    all_hash = np.concatenate([uni, bi])
    all_rows = np.concatenate([rows, rows[:-1][same]])
    order = np.argsort(all_rows, kind="stable")
    cols = (all_hash[order] % np.uint64(n_features)).astype(np.int32)
    counts = np.bincount(all_rows, minlength=n)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    scale = (1.0 / np.sqrt(np.maximum(lens, 1))).astype(np.float32)
    data = np.repeat(scale, counts)
    return sp.csr_matrix((data, cols, indptr), shape=(n, n_features))


def numeric_features(frame: pd.DataFrame) -> np.ndarray:
    """The raw numeric columns of :data:`NUMERIC` (before standardization)."""
    completion = frame["completion_text"].fillna("").astype(str)
    prompt = frame["prompt_text"].fillna("").astype(str)
    lp = pd.to_numeric(frame["mean_logprob"], errors="coerce").to_numpy(dtype=float)
    lp = np.where(np.isfinite(lp), lp, np.nan)
    cols = [
        np.log1p(completion.str.len().to_numpy(dtype=float)),
        np.log1p(completion.str.count("\n").to_numpy(dtype=float) + 1.0),
        np.log1p(pd.to_numeric(frame["num_completion_tokens"], errors="coerce").fillna(0).to_numpy(dtype=float)),
        np.log1p(prompt.str.len().to_numpy(dtype=float)),
        np.log1p(pd.to_numeric(frame["lines_added"], errors="coerce").fillna(0).clip(lower=0).to_numpy(dtype=float)),
        np.log1p(pd.to_numeric(frame["lines_removed"], errors="coerce").fillna(0).clip(lower=0).to_numpy(dtype=float)),
        lp,
        np.isnan(lp).astype(float),
    ]
    return np.column_stack(cols)


class Featurizer(TransformerMixin, BaseEstimator):  # type: ignore[misc]
    """Session frame -> sparse features (hashed n-grams, then standardized numeric columns)."""

    def __init__(self, n_features: int = 1 << 18) -> None:
        self.n_features = n_features

    def fit(self, frame: pd.DataFrame, y: Any = None) -> Featurizer:
        """Learn the numeric columns' mean and deviation (and the logprob imputation value)."""
        num = numeric_features(frame)
        lp = num[:, NUMERIC.index("mean_logprob")]
        self.logprob_fill_ = float(np.nanmedian(lp)) if np.isfinite(lp).any() else 0.0
        num[:, NUMERIC.index("mean_logprob")] = np.where(np.isnan(lp), self.logprob_fill_, lp)
        self.mean_ = num.mean(axis=0)
        std = num.std(axis=0)
        self.std_ = np.where(std > 1e-9, std, 1.0)
        return self

    def transform(self, frame: pd.DataFrame) -> sp.csr_matrix:
        """Features of ``frame`` (columns: ``n_features`` hashed, then :data:`NUMERIC`)."""
        num = numeric_features(frame)
        lp_col = NUMERIC.index("mean_logprob")
        num[:, lp_col] = np.where(np.isnan(num[:, lp_col]), self.logprob_fill_, num[:, lp_col])
        num = ((num - self.mean_) / self.std_).astype(np.float32)
        text = hash_ngrams(frame["completion_text"].fillna(""), self.n_features)
        text = text + hash_ngrams(frame["prompt_text"].fillna(""), self.n_features, _PROMPT_SALT)
        return sp.hstack([text, sp.csr_matrix(num)], format="csr")
