"""Reward signals per policy version, read from the telemetry tables with pandas.

Each session (one served response) gets one outcome per signal it received:

- ``retention`` at each horizon: lines retained / lines written (the ``signals.value`` ingest
  stores); a repeated report for the same session and horizon counts once (the latest).
- ``acceptance``: 1 for ``edit.accepted``, 0 for ``edit.rejected``.
- ``selection_win``: for every candidate of a group the user chose from, 1 if it was chosen.
- ``switch``: 1 if the user left the model after this session, else 0 (every session counts).
- ``thumbs``: +1 / -1.

Means come with a 95% normal-approximation confidence interval, ``mean ± 1.96·s/√n`` (the
central limit theorem; for proportions this is the Wald interval), or none when ``n < 2``.
Pools are a fleet notion that sessions do not carry, so rewards filter by time, model and
policy version only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import select
from sqlalchemy.orm import Session

from ingest.db import as_utc
from ingest.tables import SessionRow, SignalRow

SIGNALS = ("retention", "acceptance", "selection_win", "switch", "thumbs")
Z95 = 1.959963984540054
NICE_BUCKETS_S = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400)
OUTCOME_COLUMNS = ["session_id", "policy_version", "model", "occurred_at", "signal", "horizon_s", "value"]


@dataclass(frozen=True)
class RewardFilter:
    """Which sessions count: by the time they were served, their model and policy version."""

    since: datetime | None = None
    until: datetime | None = None
    model: str | None = None
    policy_versions: tuple[str, ...] = ()


def db_time(session: Session, ts: datetime) -> datetime:
    """``ts`` in UTC (:func:`ingest.db.as_utc`); the timestamp columns bind it on every dialect."""
    return as_utc(ts)


def _filtered(stmt: Any, f: RewardFilter) -> Any:
    if f.since is not None:
        stmt = stmt.where(SessionRow.occurred_at >= as_utc(f.since))
    if f.until is not None:
        stmt = stmt.where(SessionRow.occurred_at < as_utc(f.until))
    if f.model:
        stmt = stmt.where(SessionRow.model == f.model)
    if f.policy_versions:
        stmt = stmt.where(SessionRow.policy_version.in_(f.policy_versions))
    return stmt


def load_outcomes(session: Session, f: RewardFilter) -> pd.DataFrame:
    """One row per (session, signal[, horizon]) with the outcome value; columns ``OUTCOME_COLUMNS``."""
    base = _filtered(
        select(
            SessionRow.session_id,
            SessionRow.policy_version,
            SessionRow.model,
            SessionRow.occurred_at,
            SessionRow.group_id,
        ),
        f,
    )
    columns = ["session_id", "policy_version", "model", "occurred_at", "group_id"]
    sessions = pd.DataFrame(session.execute(base).all(), columns=columns)
    if sessions.empty:
        return pd.DataFrame(columns=OUTCOME_COLUMNS)
    sessions["occurred_at"] = pd.to_datetime(sessions["occurred_at"], utc=True)
    ids = base.with_only_columns(SessionRow.session_id).scalar_subquery()
    sig_stmt = select(SignalRow.id, SignalRow.type, SignalRow.session_id, SignalRow.horizon_s, SignalRow.value).where(
        SignalRow.session_id.in_(ids),
        SignalRow.type.in_(("code.retained", "edit.accepted", "edit.rejected", "model.switched", "feedback.thumbs")),
    )
    signals = pd.DataFrame(session.execute(sig_stmt).all(), columns=["id", "type", "session_id", "horizon_s", "value"])
    groups = base.with_only_columns(SessionRow.group_id).where(SessionRow.group_id.is_not(None)).scalar_subquery()
    sel_stmt = select(SignalRow.id, SignalRow.group_id, SignalRow.payload).where(
        SignalRow.type == "candidate.selected", SignalRow.group_id.in_(groups)
    )
    selected = pd.DataFrame(session.execute(sel_stmt).all(), columns=["id", "group_id", "payload"])

    keys = sessions[["session_id", "policy_version", "model", "occurred_at"]]
    parts: list[pd.DataFrame] = []

    ret = signals[(signals["type"] == "code.retained") & signals["value"].notna()]
    ret = ret.sort_values("id").drop_duplicates(["session_id", "horizon_s"], keep="last")
    parts.append(ret.assign(signal="retention")[["session_id", "signal", "horizon_s", "value"]])

    edits = signals[signals["type"].isin(("edit.accepted", "edit.rejected"))]
    parts.append(
        pd.DataFrame(
            {
                "session_id": edits["session_id"],
                "signal": "acceptance",
                "horizon_s": np.nan,
                "value": (edits["type"] == "edit.accepted").astype(float),
            }
        )
    )

    thumbs = signals[(signals["type"] == "feedback.thumbs") & signals["value"].notna()]
    parts.append(thumbs.assign(signal="thumbs", horizon_s=np.nan)[["session_id", "signal", "horizon_s", "value"]])

    switched = set(signals.loc[signals["type"] == "model.switched", "session_id"])
    parts.append(
        pd.DataFrame(
            {
                "session_id": sessions["session_id"],
                "signal": "switch",
                "horizon_s": np.nan,
                "value": sessions["session_id"].isin(switched).astype(float),
            }
        )
    )

    if not selected.empty:
        selected["chosen"] = [p.get("chosen_session_id") if isinstance(p, dict) else None for p in selected["payload"]]
        chosen = selected.sort_values("id").drop_duplicates("group_id", keep="last").set_index("group_id")["chosen"]
        grouped = sessions[sessions["group_id"].isin(chosen.index)]
        won = grouped["session_id"].to_numpy() == grouped["group_id"].map(chosen).to_numpy()
        parts.append(
            pd.DataFrame(
                {
                    "session_id": grouped["session_id"],
                    "signal": "selection_win",
                    "horizon_s": np.nan,
                    "value": won.astype(float),
                }
            )
        )

    nonempty = [p for p in parts if not p.empty]
    if not nonempty:
        return pd.DataFrame(columns=OUTCOME_COLUMNS)
    outcomes = pd.concat(nonempty, ignore_index=True)
    outcomes["value"] = outcomes["value"].astype(float)
    return outcomes.merge(keys, on="session_id", how="inner")[OUTCOME_COLUMNS]


def mean_ci(values: pd.Series) -> dict[str, float | int | None]:
    """Mean, count and the 95% normal-approximation interval of ``values`` (None when n < 2)."""
    n = int(values.count())
    if n == 0:
        return {"mean": None, "n": 0, "ci_low": None, "ci_high": None}
    mean = float(values.mean())
    if n < 2:
        return {"mean": mean, "n": n, "ci_low": None, "ci_high": None}
    half = Z95 * float(values.std(ddof=1)) / math.sqrt(n)
    return {"mean": mean, "n": n, "ci_low": mean - half, "ci_high": mean + half}


def select_signal(outcomes: pd.DataFrame, signal: str, horizon_s: int | None = None) -> pd.DataFrame:
    """Outcomes of one signal; for retention, one horizon (default: the longest observed)."""
    rows = outcomes[outcomes["signal"] == signal]
    if signal == "retention" and not rows.empty:
        horizon = horizon_s if horizon_s is not None else int(rows["horizon_s"].max())
        rows = rows[rows["horizon_s"] == horizon]
    return rows


def auto_bucket_s(start: pd.Timestamp, end: pd.Timestamp, target: int = 24) -> int:
    """The smallest 'nice' bucket width that splits ``[start, end]`` into at most ``target`` buckets."""
    span = max((end - start).total_seconds(), 1.0)
    for width in NICE_BUCKETS_S:
        if span / width <= target:
            return width
    return NICE_BUCKETS_S[-1]


def timeseries(rows: pd.DataFrame, bucket_s: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Per policy version and time bucket (of the session's serving time): mean and 95% CI."""
    if rows.empty:
        return bucket_s or 3600, []
    width = bucket_s or auto_bucket_s(rows["occurred_at"].min(), rows["occurred_at"].max())
    buckets = rows["occurred_at"].dt.floor(f"{width}s")
    out = []
    bucket: Any
    for (version, bucket), values in rows.groupby([rows["policy_version"], buckets], sort=True)["value"]:
        out.append({"policy_version": version, "bucket_start": bucket.to_pydatetime(), **mean_ci(values)})
    return width, out


def summary(outcomes: pd.DataFrame) -> list[dict[str, Any]]:
    """Per policy version and signal (retention per horizon): mean and 95% CI over the window."""
    out = []
    keyed = outcomes.assign(horizon_key=outcomes["horizon_s"].fillna(-1).astype(int))
    for (version, signal, horizon_key), values in keyed.groupby(["policy_version", "signal", "horizon_key"], sort=True)[
        "value"
    ]:
        horizon = int(horizon_key)  # type: ignore[call-overload]
        out.append(
            {
                "policy_version": version,
                "signal": signal,
                "horizon_s": None if horizon < 0 else horizon,
                **mean_ci(values),
            }
        )
    return out


def retention_curves(outcomes: pd.DataFrame) -> list[dict[str, Any]]:
    """Retention at each horizon, per policy version, with 95% CI."""
    return [r for r in summary(outcomes) if r["signal"] == "retention"]
