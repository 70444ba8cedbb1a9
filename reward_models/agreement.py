"""How much a candidate agrees with the other candidates of its group: a reward feature without labels.

When one request is answered K times (a candidate group, or parallel agent sessions on one task), the
answers that resemble their siblings are more often right: there are many ways to be wrong and few to
be right (the idea behind self-consistency voting and minimum-Bayes-risk selection). The feature is,
per session, the mean cosine similarity of its response to the responses of the other members of its
group present in the frame: character 2-5-grams within word boundaries, hashed (stateless, so a model
computes it the same way at training and at scoring time), unit-length rows. A session without a
group, or alone in the frame, gets NaN (the model imputes it).

Each distinct response is vectorized once and groups are processed in chunks of whole groups, so a
million sessions over a few thousand distinct texts take seconds and bounded memory.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.feature_extraction.text import HashingVectorizer

COLUMN = "group_agreement"
"""The frame column that carries the feature (computed once over all sessions before training)."""
N_FEATURES = 1 << 18
MAX_CHARS = 4_000
"""Only the start of a response counts (bounded time on huge answers)."""


def group_keys(frame: pd.DataFrame) -> pd.Series:
    """Each row's comparison group: its candidate group, else its group of parallel agent sessions; else NaN."""
    keys = pd.Series([None] * len(frame), index=frame.index, dtype=object)
    for column in ("agent_group", "group_id"):  # the candidate group wins where both exist
        if column in frame:
            values = frame[column].astype(object)
            keys = values.where(values.notna(), keys)
    return keys


def _vectors(texts: pd.Series) -> tuple[sp.csr_matrix, np.ndarray]:
    """Unit-length hashed character n-grams per distinct text, and each row's text index."""
    clean = texts.map(lambda t: t[:MAX_CHARS] if isinstance(t, str) else "")
    code, uniques = pd.factorize(clean)
    vec = HashingVectorizer(
        analyzer="char_wb", ngram_range=(2, 5), n_features=N_FEATURES, alternate_sign=False, norm="l2"
    )
    return sp.csr_matrix(vec.transform(list(uniques))), code


def group_agreement(frame: pd.DataFrame, chunk_rows: int = 10_000) -> np.ndarray:
    """Per row of ``frame``, the mean cosine similarity of its ``completion_text`` to the other members of
    its group in ``frame`` (NaN without a group or alone in it)."""
    out = np.full(len(frame), np.nan)
    if len(frame) == 0 or "completion_text" not in frame:
        return out
    codes, _ = pd.factorize(group_keys(frame).reset_index(drop=True))
    grouped = codes >= 0
    if not grouped.any():
        return out
    sizes = np.bincount(codes[grouped])
    rows = np.flatnonzero(grouped)
    rows = rows[sizes[codes[rows]] >= 2]
    if rows.size == 0:
        return out
    rows = rows[np.argsort(codes[rows], kind="stable")]
    group = codes[rows]
    vectors, text_of = _vectors(frame["completion_text"].reset_index(drop=True).iloc[rows])
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    cuts = np.r_[starts[np.r_[True, np.diff(starts // chunk_rows) > 0]], len(rows)]
    for lo, hi in itertools.pairwise(cuts):
        local, member_of = np.unique(group[lo:hi], return_inverse=True)
        v = vectors[text_of[lo:hi]]
        members = sp.csr_matrix((np.ones(hi - lo), (member_of, np.arange(hi - lo))), shape=(len(local), hi - lo))
        totals = sp.csr_matrix(members @ v)
        with_all = np.asarray(v.multiply(totals[member_of]).sum(axis=1)).ravel()
        with_self = np.asarray(v.multiply(v).sum(axis=1)).ravel()
        out[rows[lo:hi]] = (with_all - with_self) / (sizes[group[lo:hi]] - 1)
    return out


def with_group_agreement(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the :data:`COLUMN` of :func:`group_agreement` (computed over all its rows)."""
    return frame.assign(**{COLUMN: group_agreement(frame)})
