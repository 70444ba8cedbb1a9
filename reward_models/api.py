"""The Python API the policy trainer and the scheduler call.

- :func:`load_scorer` -> :class:`Scorer` with ``score(records) -> np.ndarray`` (and
  ``score_with_error``: each score's standard error over the users who trained it): score sessions held
  in memory (rollouts the trainer just generated), given as a session frame, a list of
  ``session.completed`` envelopes, or a list of ``{"prompt": str, "completion": str,
  "mean_logprob"?: float}`` dicts.
- :func:`score_sessions`: score stored sessions by id -> ``{session_id: reward}``.
- :func:`hacking_check`: the reward-hacking guard over the database (proxy vs real retention
  per policy version).
- :func:`promotion_check`: the same guard for one promotion (a candidate policy version against
  the version it would replace); the deployer and the promote action refuse a flagged candidate.
- :func:`recent_scores`: the promoted version's scores on the newest sessions it was not trained
  on, what :func:`reward_models.triggers.retrain_decision` checks for drift.

Rewards are on the log-odds scale (higher is better; ``sigmoid`` gives a keep probability for
the pointwise heads). The privileged model is never used here: it needs what the user kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy.engine import Engine

from ingest.db import as_utc
from reward_models import registry
from reward_models.config import RewardsConfig
from reward_models.data import SESSION_COLUMNS, load_sessions, load_signals, session_records
from reward_models.guard import HackingReport, promotion_guard, reward_hacking
from reward_models.labels import retention_labels
from reward_models.models import RewardBundle


def records_frame(records: Any) -> pd.DataFrame:
    """A session frame from a frame, envelopes (``{"type": "session.completed", ...}``) or plain text dicts."""
    if isinstance(records, pd.DataFrame):
        frame = records.copy()
    else:
        items = list(records)
        if items and all(isinstance(r, dict) and "payload" in r for r in items):
            frame = session_records(items)
        else:
            rows = []
            for i, r in enumerate(items):
                if not isinstance(r, dict):
                    raise TypeError(f"record {i} is a {type(r).__name__}, expected a dict")
                rows.append(
                    {
                        "session_id": r.get("session_id", str(i)),
                        "prompt_text": r.get("prompt", r.get("prompt_text", "")),
                        "completion_text": r.get("completion", r.get("completion_text", "")),
                        "mean_logprob": r.get("mean_logprob", float("nan")),
                        "num_completion_tokens": r.get("num_completion_tokens", 0),
                    }
                )
            frame = pd.DataFrame(rows)
    for col in SESSION_COLUMNS:
        if col not in frame:
            frame[col] = 0 if col in ("num_completion_tokens", "lines_added", "lines_removed") else None
    frame["prompt_text"] = frame["prompt_text"].fillna("").astype(str)
    frame["completion_text"] = frame["completion_text"].fillna("").astype(str)
    frame["mean_logprob"] = pd.to_numeric(frame["mean_logprob"], errors="coerce")
    return frame


@dataclass
class Scorer:
    """A loaded reward-model version."""

    version: str
    bundle: RewardBundle

    def score(self, records: Any) -> np.ndarray:
        """Rewards of ``records`` in order (float64, log-odds scale); empty input -> empty array."""
        frame = records_frame(records)
        if frame.empty:
            return np.zeros(0)
        return np.asarray(self.bundle.score(frame), dtype=np.float64)

    def score_with_error(self, records: Any) -> tuple[np.ndarray, np.ndarray]:
        """Rewards of ``records`` and their standard errors over the users who trained the model
        (:meth:`~reward_models.models.RewardBundle.score_with_error`), both float64 in order."""
        frame = records_frame(records)
        if frame.empty:
            return np.zeros(0), np.zeros(0)
        score, error = self.bundle.score_with_error(frame)
        return np.asarray(score, dtype=np.float64), np.asarray(error, dtype=np.float64)

    def head_scores(self, records: Any) -> dict[str, np.ndarray]:
        """Each head's score (retention, acceptance, selection) for diagnostics."""
        return self.bundle.head_scores(records_frame(records))


def load_scorer(engine: Engine, version: str = "latest") -> Scorer:
    """The scorer of ``version`` (``latest``: the promoted one); its artifact hash is verified."""
    row = registry.get_version(engine, version)
    return Scorer(row.version, registry.load_bundle(row))


def score_sessions(engine: Engine, session_ids: Sequence[str], version: str = "latest") -> dict[str, float]:
    """Rewards of stored sessions by id; ids that are not stored are left out of the result."""
    scorer = load_scorer(engine, version)
    frame = load_sessions(engine, session_ids=list(session_ids))
    if frame.empty:
        return {}
    scores = scorer.score(frame)
    return {sid: float(s) for sid, s in zip(frame["session_id"], scores, strict=True)}


def hacking_check(
    engine: Engine, config: RewardsConfig, *, version: str = "latest", now: datetime | None = None, min_z: float = 0.0
) -> HackingReport:
    """The reward-hacking guard on stored data: proxy = this version's reward, real = final retention
    (``min_z``: the fall must also be that many standard errors, :func:`reward_models.guard.reward_hacking`)."""
    now = now or datetime.now(UTC)
    sessions = load_sessions(engine, until=now)
    if sessions.empty:
        return HackingReport(False, "no sessions")
    labels, _ = retention_labels(sessions, load_signals(engine, types=["code.retained"]), config, now)
    scorer = load_scorer(engine, version)
    frame = sessions.set_index("session_id").join(labels)
    frame = frame[frame["retention_final"].astype(bool)]
    if frame.empty:
        return HackingReport(False, "no session has a final retention label yet")
    proxy = scorer.score(frame.reset_index())
    per_session = pd.DataFrame(
        {
            "policy_version": frame["policy_version"].to_numpy(),
            "proxy": proxy,
            "real": frame["retention"].to_numpy(),
            "order": frame["occurred_at"].to_numpy(),
        }
    )
    return reward_hacking(per_session, config, min_z=min_z)


def _proxy_and_real(
    engine: Engine, config: RewardsConfig, sessions: pd.DataFrame, version: str, now: datetime
) -> pd.DataFrame:
    """Rows ``policy_version, proxy, real, order`` of the sessions with a final retention label."""
    labels, _ = retention_labels(sessions, load_signals(engine, types=["code.retained"]), config, now)
    frame = sessions.set_index("session_id").join(labels)
    frame = frame[frame["retention_final"].fillna(False).astype(bool)]
    if frame.empty:
        return pd.DataFrame(columns=["policy_version", "proxy", "real", "order"])
    proxy = load_scorer(engine, version).score(frame.reset_index())
    return pd.DataFrame(
        {
            "policy_version": frame["policy_version"].to_numpy(),
            "proxy": proxy,
            "real": frame["retention"].to_numpy(),
            "order": frame["occurred_at"].to_numpy(),
        }
    )


def promotion_check(
    engine: Engine,
    config: RewardsConfig,
    *,
    candidate: str,
    incumbent: str,
    version: str = "latest",
    now: datetime | None = None,
) -> HackingReport:
    """The reward-hacking guard for promoting policy ``candidate`` over ``incumbent``.

    Proxy: the reward model ``version``'s score of each version's sessions; real: their final
    retention. Not flagged (and saying why) when no reward model is promoted, or when either
    version has fewer than ``guard_min_sessions`` sessions with a final retention label.
    """
    if candidate == incumbent:
        return HackingReport(False, f"{candidate} is the version the pool serves; nothing to compare")
    if version == "latest" and registry.current_promoted(engine) is None:
        return HackingReport(False, "no promoted reward model: the reward-hacking guard cannot judge, not blocking")
    now = now or datetime.now(UTC)
    sessions = load_sessions(engine, until=now)
    sessions = sessions[sessions["policy_version"].isin([candidate, incumbent])] if not sessions.empty else sessions
    per_session = (
        _proxy_and_real(engine, config, sessions.reset_index(drop=True), version, now)
        if not sessions.empty
        else pd.DataFrame(columns=["policy_version", "proxy", "real", "order"])
    )
    return promotion_guard(per_session, config, incumbent=incumbent, candidate=candidate)


def recent_scores(engine: Engine, config: RewardsConfig, *, now: datetime | None = None) -> np.ndarray | None:
    """The promoted version's scores on the newest ``drift_recent_sessions`` sessions of the last
    ``drift_window_s`` that occurred after its training window (those it has not seen); None when no
    version is promoted."""
    current = registry.current_promoted(engine)
    if current is None:
        return None
    now = now or datetime.now(UTC)
    since = now - timedelta(seconds=config.drift_window_s)
    if current.window_end is not None:
        since = max(since, as_utc(current.window_end))
    sessions = load_sessions(engine, since=since, until=now)
    if current.window_end is not None and not sessions.empty:
        end = pd.Timestamp(current.window_end)
        end = end.tz_localize("UTC") if end.tzinfo is None else end
        occurred = pd.to_datetime(sessions["occurred_at"], utc=True)
        sessions = sessions[occurred > end]
    sessions = sessions.tail(config.drift_recent_sessions)
    if sessions.empty:
        return np.zeros(0)
    return Scorer(current.version, registry.load_bundle(current)).score(sessions.reset_index(drop=True))
