"""Read sessions and signals from the ingest tables into pandas frames.

``load_sessions`` returns one row per session (for an agent session, one per turn, with the
session's id in ``agent_session``) with the texts the reward models read, the
policy's own mean logprob over the generated tokens (its confidence, the baseline every model
must beat) and edit statistics from ``files``. ``load_signals`` returns every signal row with
its payload. Times are timezone-aware UTC, as the ingest tables' columns return them.
Besides the mean, ``logprob_min`` and ``logprob_std`` summarize the served token logprobs; a
session without per-token logprobs takes all three from its payload's ``served_logprobs`` summary
(``{mean, min, std, ...}``: what a source that logged only a summary sends), else NaN.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import select
from sqlalchemy.engine import Engine

from ingest.arrays import unpack_floats
from ingest.tables import SegmentRow, SessionRow, SignalRow

SESSION_COLUMNS = [
    "session_id",
    "user_id",
    "occurred_at",
    "policy_version",
    "model",
    "group_id",
    "candidate_index",
    "prompt_text",
    "completion_text",
    "num_completion_tokens",
    "mean_logprob",
    "lines_added",
    "lines_removed",
    "agent_session",
    "logprob_min",
    "logprob_std",
    "agent_group",
]
LOGPROB_COLUMNS = ("mean_logprob", "logprob_min", "logprob_std")
"""The served-logprob summaries of a session (the policy's confidence in what it answered)."""
SIGNAL_COLUMNS = [
    "event_id",
    "type",
    "session_id",
    "user_id",
    "group_id",
    "occurred_at",
    "horizon_s",
    "value",
    "payload",
]
_CHUNK = 500


def logprob_stats(chunks: Sequence[bytes | None], served: Any = None) -> tuple[float, float, float]:
    """Mean, min and standard deviation of the logprobs packed in ``chunks``, else of the ``served`` summary.

    NaN where a value is missing or not finite (one non-finite token logprob makes all three NaN).
    """
    arrays = [unpack_floats(raw) for raw in chunks if raw]
    return _stats(np.concatenate(arrays) if arrays else np.zeros(0), served)


def _stats(values: np.ndarray, served: Any) -> tuple[float, float, float]:
    """``(mean, min, std)`` of the token logprobs ``values``, else of the ``served`` summary."""
    if values.size:
        if not np.all(np.isfinite(values)):
            return float("nan"), float("nan"), float("nan")
        return float(values.mean()), float(values.min()), float(values.std())
    return _served_stats(served)


def _served_stats(served: Any) -> tuple[float, float, float]:
    """``(mean, min, std)`` of a payload's ``served_logprobs`` summary; NaN for what it lacks."""
    out = []
    for key in ("mean", "min", "std"):
        value = served.get(key) if isinstance(served, dict) else None
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else float("nan")
        out.append(number if np.isfinite(number) else float("nan"))
    return out[0], out[1], out[2]


def _agent_session(extra: dict[str, Any] | None) -> str | None:
    """The agent session a turn belongs to (``payload.turn.session_id``), if any."""
    turn = (extra or {}).get("turn")
    return str(turn["session_id"]) if isinstance(turn, dict) and turn.get("session_id") else None


def _agent_group(extra: dict[str, Any] | None) -> str | None:
    """The group of parallel agent sessions a turn's session ran in (``payload.turn.group``), if any."""
    turn = (extra or {}).get("turn")
    return str(turn["group"]) if isinstance(turn, dict) and turn.get("group") else None


def _edit_stats(extra: dict[str, Any] | None) -> tuple[float, float]:
    files = (extra or {}).get("files") or []
    added = sum(int(f.get("lines_added") or 0) for f in files if isinstance(f, dict))
    removed = sum(int(f.get("lines_removed") or 0) for f in files if isinstance(f, dict))
    return float(added), float(removed)


def load_sessions(
    engine: Engine,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    session_ids: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Sessions in ``[since, until)`` (or exactly ``session_ids``), oldest first."""
    cols = [
        SessionRow.session_id,
        SessionRow.user_id,
        SessionRow.occurred_at,
        SessionRow.policy_version,
        SessionRow.model,
        SessionRow.group_id,
        SessionRow.candidate_index,
        SessionRow.prompt_text,
        SessionRow.completion_text,
        SessionRow.num_completion_tokens,
        SessionRow.extra,
    ]
    rows: list[Any] = []
    logprobs: dict[str, list[bytes | None]] = {}
    with engine.connect() as conn:
        if session_ids is not None:
            ids = list(dict.fromkeys(session_ids))
            batches = [ids[i : i + _CHUNK] for i in range(0, len(ids), _CHUNK)]
        else:
            batches = [None]  # type: ignore[list-item]
        for batch in batches:
            query = select(*cols)
            seg_query = select(SegmentRow.session_id, SegmentRow.logprobs).where(SegmentRow.role == "assistant")
            if batch is not None:
                query = query.where(SessionRow.session_id.in_(batch))
                seg_query = seg_query.where(SegmentRow.session_id.in_(batch))
            if since is not None:
                query = query.where(SessionRow.occurred_at >= since)
            if until is not None:
                query = query.where(SessionRow.occurred_at < until)
            if batch is None and (since is not None or until is not None):
                seg_query = seg_query.join(SessionRow, SessionRow.session_id == SegmentRow.session_id)
                if since is not None:
                    seg_query = seg_query.where(SessionRow.occurred_at >= since)
                if until is not None:
                    seg_query = seg_query.where(SessionRow.occurred_at < until)
            rows.extend(conn.execute(query).all())
            for sid, raw in conn.execute(seg_query.order_by(SegmentRow.session_id, SegmentRow.idx)):
                logprobs.setdefault(sid, []).append(raw)
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in SESSION_COLUMNS})
    records = []
    for r in rows:
        added, removed = _edit_stats(r.extra)
        lp_mean, lp_min, lp_std = logprob_stats(logprobs.get(r.session_id, []), (r.extra or {}).get("served_logprobs"))
        records.append(
            {
                "session_id": r.session_id,
                "user_id": r.user_id,
                "occurred_at": r.occurred_at,
                "policy_version": r.policy_version,
                "model": r.model,
                "group_id": r.group_id,
                "candidate_index": r.candidate_index,
                "prompt_text": r.prompt_text or "",
                "completion_text": r.completion_text or "",
                "num_completion_tokens": r.num_completion_tokens or 0,
                "mean_logprob": lp_mean,
                "lines_added": added,
                "lines_removed": removed,
                "agent_session": _agent_session(r.extra),
                "logprob_min": lp_min,
                "logprob_std": lp_std,
                "agent_group": _agent_group(r.extra),
            }
        )
    frame = pd.DataFrame.from_records(records, columns=SESSION_COLUMNS)
    frame["occurred_at"] = pd.to_datetime(frame["occurred_at"], utc=True)
    return frame.sort_values(["occurred_at", "session_id"], kind="stable").reset_index(drop=True)


def load_signals(engine: Engine, *, types: Sequence[str] | None = None) -> pd.DataFrame:
    """Every signal (optionally of ``types``) in arrival-independent order: by ``occurred_at``, then ``event_id``."""
    query = select(
        SignalRow.event_id,
        SignalRow.type,
        SignalRow.session_id,
        SignalRow.user_id,
        SignalRow.group_id,
        SignalRow.occurred_at,
        SignalRow.horizon_s,
        SignalRow.value,
        SignalRow.payload,
    )
    if types is not None:
        query = query.where(SignalRow.type.in_(list(types)))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in SIGNAL_COLUMNS})
    frame = pd.DataFrame.from_records([tuple(r) for r in rows], columns=SIGNAL_COLUMNS)
    frame["occurred_at"] = pd.to_datetime(frame["occurred_at"], utc=True)
    frame["payload"] = frame["payload"].map(lambda p: p if isinstance(p, dict) else {})
    return frame.sort_values(["occurred_at", "event_id"], kind="stable").reset_index(drop=True)


def session_records(events: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Session frame built from ``session.completed`` envelopes (plain dicts) in input order, no database.

    What ``undertow rewards score --input FILE`` and in-memory scoring read; envelopes of other
    types are ignored by the caller before this.
    """
    records = []
    for ev in events:
        p = ev.get("payload") or {}
        segments = [s for s in (p.get("segments") or []) if isinstance(s, dict)]
        assistant = [s for s in segments if s.get("role") == "assistant"]
        lps = np.asarray([float(x) for s in assistant for x in (s.get("logprobs") or [])], dtype=np.float64)
        lp_mean, lp_min, lp_std = _stats(lps, p.get("served_logprobs"))
        prompt = p.get("prompt") or {}
        added, removed = _edit_stats({"files": p.get("files") or []})
        records.append(
            {
                "session_id": ev.get("session_id"),
                "user_id": ev.get("user_id"),
                "occurred_at": ev.get("occurred_at"),
                "policy_version": p.get("policy_version"),
                "model": p.get("model"),
                "group_id": p.get("group_id"),
                "candidate_index": p.get("candidate_index"),
                "prompt_text": prompt.get("text") or "" if isinstance(prompt, dict) else "",
                "completion_text": "".join(str(s.get("text") or "") for s in assistant),
                "num_completion_tokens": sum(len(s.get("token_ids") or []) for s in assistant),
                "mean_logprob": lp_mean,
                "lines_added": added,
                "lines_removed": removed,
                "agent_session": _agent_session(p),
                "logprob_min": lp_min,
                "logprob_std": lp_std,
                "agent_group": _agent_group(p),
            }
        )
    return pd.DataFrame.from_records(records, columns=SESSION_COLUMNS)


def signal_records(events: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Signal frame (:data:`SIGNAL_COLUMNS`) from contract envelopes (plain dicts), no database.

    What :func:`load_signals` would return after ingest stored ``events``: each envelope is
    validated against the contract and turned into its ``signals`` row by ingest's own
    :func:`~ingest.rows.signal_row`; ``session.completed`` envelopes are skipped; an ``event_id``
    seen before counts once (the first, as ingest keeps it). Ordered by ``occurred_at``, then ``event_id``.
    """
    from ingest.rows import signal_row
    from ingest.schemas import validate_event

    records = []
    seen: set[str] = set()
    received = datetime.now(UTC)
    for raw in events:
        if raw.get("type") == "session.completed" or raw.get("event_id") in seen:
            continue
        row = signal_row(validate_event(raw), received)
        seen.add(row["event_id"])
        payload = json.loads(row["payload"]) if isinstance(row["payload"], str) else row["payload"]
        records.append(
            {**{c: row.get(c) for c in SIGNAL_COLUMNS}, "payload": payload if isinstance(payload, dict) else {}}
        )
    if not records:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in SIGNAL_COLUMNS})
    frame = pd.DataFrame.from_records(records, columns=SIGNAL_COLUMNS)
    frame["occurred_at"] = pd.to_datetime(frame["occurred_at"], utc=True)
    return frame.sort_values(["occurred_at", "event_id"], kind="stable").reset_index(drop=True)
