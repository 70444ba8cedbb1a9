"""Labels from user signals: retention, acceptance, selection pairs, model switch, thumbs, churn,
optional judge scores, and the composite reward with per-signal coverage.

Every label is a pure function of the stored sessions and signals and an explicit ``now``, so
late, repeated or early signals change exactly what they should:

- a signal that arrives before its session is stored and joined whenever the session arrives;
- the same measurement sent twice under two event ids (same session, type and horizon) counts
  once: the latest by ``occurred_at`` wins (event-id ties broken by id), never the sum;
- a retention horizon that has not elapsed yet is *pending*, not zero: the combined label uses
  only measured horizons, and a session is *final* only once its longest configured horizon was
  measured or has elapsed plus a grace period. Labels use what was measured so far by default
  (``rewards.retention_require_final``: only final ones); the guards use final retention.

Only the user a session was served to labels it: a signal naming another user is ignored and
counted (``foreign_user_signals``; ``rewards.require_session_user``). The gateway refuses such
signals; this holds for a direct producer and for rows stored before it did. A signal that names
no user counts as before.

Churn is user level and high-bias/low-variance (users leave for reasons unrelated to any one
answer), so it is optional (weight 0 by default). Thumbs are collected but weighted 0 by
default: explicit ratings reward agreeable, flattering answers (sycophancy) more than code that
works, and only a small, self-selected fraction of users ever click them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from reward_models.config import RewardsConfig

SIGNALS = ("retention", "acceptance", "selection", "switch", "thumbs", "churn")


@dataclass
class LabelSet:
    """Per-session labels (index ``session_id``), selection pairs and what was skipped and why."""

    sessions: pd.DataFrame
    pairs: pd.DataFrame
    skipped: dict[str, int] = field(default_factory=dict)
    position: dict[str, Any] = field(default_factory=dict)


def horizon_weight(horizon_s: int, weights: dict[int, float]) -> float:
    """Weight of a horizon: the configured weight of the largest configured horizon <= it."""
    keys = sorted(int(k) for k in weights)
    if not keys:
        return 1.0
    below = [k for k in keys if k <= horizon_s]
    return float(weights[below[-1]] if below else weights[keys[0]])


def _latest(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The latest row per ``keys`` (by occurred_at, then event_id): repeated measurements count once."""
    if frame.empty:
        return frame
    ordered = frame.sort_values(["occurred_at", "event_id"], kind="stable")
    return ordered.drop_duplicates(keys, keep="last")


def retention_labels(
    sessions: pd.DataFrame, signals: pd.DataFrame, config: RewardsConfig, now: datetime
) -> tuple[pd.DataFrame, dict[str, int]]:
    """Combined retention per session: ``sum_h w_h f_h / sum_h w_h`` over measured horizons ``h``.

    ``f_h = lines_retained / lines_written`` at horizon ``h`` (measurements with nothing written
    are skipped and counted). Returns columns ``retention`` (NaN when nothing was measured),
    ``retention_final`` and ``retention_horizons`` (how many horizons were measured).
    """
    skipped: dict[str, int] = {}
    ret = signals[signals["type"] == "code.retained"].copy() if not signals.empty else signals
    out = pd.DataFrame(index=pd.Index(sessions["session_id"], name="session_id"))
    out["retention"] = np.nan
    out["retention_horizons"] = 0
    if not ret.empty:
        written = ret["payload"].map(lambda p: p.get("lines_written"))
        kept = ret["payload"].map(lambda p: p.get("lines_retained"))
        frac = pd.to_numeric(kept, errors="coerce") / pd.to_numeric(written, errors="coerce").replace(0, np.nan)
        ret["frac"] = frac.where(frac.notna(), pd.to_numeric(ret["value"], errors="coerce"))
        ret["horizon_s"] = pd.to_numeric(ret["horizon_s"], errors="coerce").fillna(
            ret["payload"].map(lambda p: p.get("horizon_s")).astype(float)
        )
        bad = ret["frac"].isna() | ~np.isfinite(ret["frac"]) | ret["horizon_s"].isna()
        skipped["retention_unmeasurable"] = int(bad.sum())
        ret = _latest(ret[~bad], ["session_id", "horizon_s"])
        ret["frac"] = ret["frac"].clip(0.0, 1.0)
        ret["w"] = ret["horizon_s"].map(lambda h: horizon_weight(int(h), config.retention_weights))
        ret["wf"] = ret["w"] * ret["frac"]
        grouped = ret.groupby("session_id").agg(
            wf=("wf", "sum"), w=("w", "sum"), n=("frac", "size"), hmax=("horizon_s", "max")
        )
        grouped = grouped[grouped.index.isin(out.index)]
        out.loc[grouped.index, "retention"] = grouped["wf"] / grouped["w"]
        out.loc[grouped.index, "retention_horizons"] = grouped["n"].astype(int)
        measured_max = grouped["hmax"].reindex(out.index)
    else:
        measured_max = pd.Series(np.nan, index=out.index)
    longest = max((int(k) for k in config.retention_weights), default=0)
    occurred = pd.to_datetime(sessions.set_index("session_id")["occurred_at"], utc=True).reindex(out.index)
    age_s = (pd.Timestamp(now).tz_convert("UTC") - occurred).dt.total_seconds()
    elapsed = age_s >= longest + config.retention_grace_s
    out["retention_final"] = out["retention"].notna() & ((measured_max >= longest) | elapsed)
    skipped["retention_pending"] = int((out["retention"].notna() & ~out["retention_final"]).sum())
    return out, skipped


def acceptance_labels(sessions: pd.DataFrame, signals: pd.DataFrame) -> pd.Series:
    """Fraction of a session's distinct edits that were accepted (an edit decided twice: latest wins)."""
    idx = pd.Index(sessions["session_id"], name="session_id")
    if signals.empty:
        return pd.Series(np.nan, index=idx, name="acceptance")
    edits = signals[signals["type"].isin(["edit.accepted", "edit.rejected"])].copy()
    if edits.empty:
        return pd.Series(np.nan, index=idx, name="acceptance")
    edits["edit_key"] = edits.apply(lambda r: r["payload"].get("edit_id") or r["event_id"], axis=1)
    edits = _latest(edits, ["session_id", "edit_key"])
    edits["accepted"] = (edits["type"] == "edit.accepted").astype(float)
    return edits.groupby("session_id")["accepted"].mean().reindex(idx).rename("acceptance")


def selection_pairs(sessions: pd.DataFrame, signals: pd.DataFrame) -> pd.DataFrame:
    """One pair per (chosen, other) candidate shown together: ``chosen, rejected, chosen_pos, rejected_pos, k``.

    The display order comes from ``candidates.shown``; without it, from ``candidate_index``
    (``position_source`` says which). A group selected twice counts its latest selection.
    """
    cols = ["group_id", "chosen", "rejected", "chosen_pos", "rejected_pos", "k", "position_source", "occurred_at"]
    if signals.empty:
        return pd.DataFrame(columns=cols)
    sel = signals[signals["type"] == "candidate.selected"].copy()
    if sel.empty:
        return pd.DataFrame(columns=cols)
    sel["gid"] = sel["payload"].map(lambda p: p.get("group_id"))
    sel["chosen"] = sel["payload"].map(lambda p: p.get("chosen_session_id"))
    sel = _latest(sel.dropna(subset=["gid", "chosen"]), ["gid"])
    shown_rows = signals[signals["type"] == "candidates.shown"].copy()
    shown: dict[str, list[str]] = {}
    if not shown_rows.empty:
        shown_rows["gid"] = shown_rows["payload"].map(lambda p: p.get("group_id"))
        for gid, payload in zip(
            _latest(shown_rows, ["gid"])["gid"], _latest(shown_rows, ["gid"])["payload"], strict=True
        ):
            ids = payload.get("session_ids") or []
            shown[str(gid)] = [str(s) for s in ids]
    by_group: dict[str, list[str]] = {}
    known = sessions.dropna(subset=["group_id"])
    for gid, grp in known.groupby("group_id"):
        by_group[str(gid)] = list(grp.sort_values("candidate_index")["session_id"])
    records = []
    for gid, chosen, ts in zip(sel["gid"], sel["chosen"], sel["occurred_at"], strict=True):
        order, source = (shown[gid], "shown") if gid in shown else (by_group.get(gid, []), "candidate_index")
        if chosen not in order:
            continue
        cpos = order.index(chosen)
        for pos, other in enumerate(order):
            if other != chosen:
                records.append((gid, chosen, other, cpos, pos, len(order), source, ts))
    return pd.DataFrame.from_records(records, columns=cols)


def position_bias(pairs: pd.DataFrame) -> dict[str, Any]:
    """Selection rate by display position vs the unbiased ``1/K``, and inverse-propensity weights.

    Rate per position ``p``: ``P(chosen at p) / P(shown at p)`` estimated from the groups; the
    bias statistic is the largest ``|rate_p * K - 1|``. Pair weight ``w = 1 / (K * rate_{pos_c})``
    (clipped to [0.2, 5]) down-weights choices explained by where a candidate was shown
    (Joachims et al., "Unbiased Learning-to-Rank with Biased Feedback", WSDM 2017).
    """
    if pairs.empty:
        return {"groups": 0, "rate_by_position": {}, "max_relative_bias": 0.0}
    groups = pairs.drop_duplicates("group_id")
    k = groups["k"].to_numpy(dtype=float)
    chosen_pos = groups["chosen_pos"].to_numpy(dtype=int)
    max_k = int(k.max())
    shown_at = np.array([(k > p).sum() for p in range(max_k)], dtype=float)
    chosen_at = np.bincount(chosen_pos, minlength=max_k).astype(float)
    expected = np.array([(1.0 / k[k > p]).sum() for p in range(max_k)])
    rate = np.divide(chosen_at, expected, out=np.ones(max_k), where=expected > 0)
    return {
        "groups": len(groups),
        "shown_by_position": shown_at.astype(int).tolist(),
        "chosen_by_position": chosen_at.astype(int).tolist(),
        "rate_by_position": {str(p): float(rate[p]) for p in range(max_k)},
        "max_relative_bias": float(np.max(np.abs(rate[shown_at > 0] - 1.0))),
    }


def pair_weights(pairs: pd.DataFrame, bias: dict[str, Any]) -> np.ndarray:
    """Inverse-propensity weights of :func:`position_bias` (all ones without position data)."""
    if pairs.empty or not bias.get("rate_by_position"):
        return np.ones(len(pairs))
    rate = np.array([bias["rate_by_position"].get(str(int(p)), 1.0) for p in pairs["chosen_pos"]])
    return np.clip(1.0 / np.maximum(rate, 1e-6), 0.2, 5.0)


def session_signal_labels(sessions: pd.DataFrame, signals: pd.DataFrame, config: RewardsConfig) -> pd.DataFrame:
    """Switch (1 when the user left this session's model), thumbs mean in [-1, 1] and churn (0/1 or NaN)."""
    idx = pd.Index(sessions["session_id"], name="session_id")
    out = pd.DataFrame(index=idx)
    out["switch"] = np.nan
    out["thumbs"] = np.nan
    out["churn"] = np.nan
    if signals.empty:
        return out
    switched = set(signals.loc[signals["type"] == "model.switched", "session_id"].dropna())
    out.loc[out.index.isin(switched), "switch"] = 1.0
    thumbs = _latest(signals[signals["type"] == "feedback.thumbs"], ["session_id"])
    if not thumbs.empty:
        tv = thumbs.set_index("session_id")["payload"].map(lambda p: p.get("value")).astype(float)
        tv = tv[tv.index.isin(idx)]
        out.loc[tv.index, "thumbs"] = tv
    churned = _latest(signals[signals["type"] == "user.churned"], ["user_id"]).dropna(subset=["user_id"])
    if not churned.empty and "user_id" in sessions:
        when = churned.set_index("user_id")["occurred_at"]
        user = sessions.set_index("session_id")["user_id"].reindex(idx)
        occurred = pd.to_datetime(sessions.set_index("session_id")["occurred_at"], utc=True).reindex(idx)
        churn_at = user.map(when)
        has = churn_at.notna()
        delta = (pd.to_datetime(churn_at[has], utc=True) - occurred[has]).dt.total_seconds()
        out.loc[delta.index, "churn"] = ((delta >= 0) & (delta <= config.churn_window_s)).astype(float)
    return out


def composite(labels: pd.DataFrame, weights: dict[str, float]) -> pd.Series:
    """Composite reward in [0, 1]: ``sum_s w_s u_s / sum_s w_s`` over the signals a session has.

    Utilities ``u``: retention and acceptance as is; selection win rate; switch ``1 - switch``
    (only present when switched: 0); thumbs ``(v + 1) / 2``; churn ``1 - churn``; judge scores
    as is. NaN when a session has no signal with positive weight.
    """
    utility = pd.DataFrame(index=labels.index)
    for name in labels.columns:
        if name in ("retention", "acceptance", "selection") or name.startswith("judge:"):
            utility[name] = labels[name]
        elif name in ("switch", "churn"):
            utility[name] = 1.0 - labels[name]
        elif name == "thumbs":
            utility[name] = (labels[name] + 1.0) / 2.0
    num = pd.Series(0.0, index=labels.index)
    den = pd.Series(0.0, index=labels.index)
    for name, w in weights.items():
        if w <= 0 or name not in utility:
            continue
        present = utility[name].notna()
        num = num + w * utility[name].fillna(0.0)
        den = den + w * present
    return (num / den.where(den > 0)).rename("reward")


def coverage(labels: pd.DataFrame, weights: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per signal: sessions covered, fraction covered, mean value and weight."""
    n = max(len(labels), 1)
    out = {}
    for name in labels.columns:
        if name not in SIGNALS and not name.startswith("judge:") and name != "reward":
            continue
        col = labels[name]
        count = int(col.notna().sum())
        out[name] = {
            "sessions": count,
            "fraction": count / n,
            "mean": float(col.mean()) if count else float("nan"),
            "weight": float(weights.get(name, 0.0)),
        }
    return out


def session_wide(sessions: pd.DataFrame, signals: pd.DataFrame) -> pd.DataFrame:
    """Signals aimed at a whole agent session, copied onto each of its turns.

    A signal may target one turn (its stored session id, ``S.t{n}``) or the agent session ``S``;
    the latter reaches every turn of ``S`` (a session's outcome credits all its turns). A turn's
    own signal of the same kind, if later, still wins (labels keep the latest).
    """
    if signals.empty or "agent_session" not in sessions or sessions["agent_session"].isna().all():
        return signals
    turns = sessions.dropna(subset=["agent_session"])[["agent_session", "session_id"]]
    known = set(sessions["session_id"])
    wide = signals[signals["session_id"].isin(set(turns["agent_session"])) & ~signals["session_id"].isin(known)]
    if wide.empty:
        return signals
    copies = wide.merge(turns, left_on="session_id", right_on="agent_session", suffixes=("_target", ""))
    copies["event_id"] = copies["event_id"] + "@" + copies["session_id"]
    copies = copies[signals.columns]
    rest = signals.drop(index=wide.index)
    merged = pd.concat([rest, copies], ignore_index=True)
    return merged.sort_values(["occurred_at", "event_id"], kind="stable").reset_index(drop=True)


def signal_targets(signals: pd.DataFrame) -> pd.Series:
    """The session each signal is about: ``payload.chosen_session_id`` for a selection, else ``session_id``."""
    if signals.empty:
        return pd.Series(dtype=object, index=signals.index)
    target = signals["session_id"].astype(object)
    chosen = signals["payload"].map(lambda p: p.get("chosen_session_id") if isinstance(p, dict) else None)
    is_selection = (signals["type"] == "candidate.selected") & chosen.notna()
    return target.where(~is_selection, chosen)


def foreign_user_mask(sessions: pd.DataFrame, signals: pd.DataFrame) -> pd.Series:
    """True for a signal that names a user other than the one its session was served to.

    The session is :func:`signal_targets`' (a stored turn, or an agent session through its turns).
    A signal without ``user_id``, about an unknown session, or about a session without a user is
    not foreign; ``user.churned`` names no session and stays user level.
    """
    if signals.empty or "user_id" not in signals or "user_id" not in sessions:
        return pd.Series(False, index=signals.index, dtype=bool)
    owner = sessions.dropna(subset=["user_id"]).drop_duplicates("session_id").set_index("session_id")["user_id"]
    if "agent_session" in sessions:
        turns = sessions.dropna(subset=["user_id", "agent_session"]).drop_duplicates("agent_session")
        agent_owner = turns.set_index("agent_session")["user_id"]
        owner = pd.concat([owner, agent_owner[~agent_owner.index.isin(owner.index)]])
    served_to = signal_targets(signals).map(owner)
    named = signals["user_id"]
    foreign = named.notna() & served_to.notna() & (named.astype(str) != served_to.astype(str))
    return foreign.astype(bool)


def own_user_signals(sessions: pd.DataFrame, signals: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """``signals`` without the foreign-user ones (:func:`foreign_user_mask`), and how many were dropped."""
    foreign = foreign_user_mask(sessions, signals)
    if not foreign.any():
        return signals, 0
    return signals[~foreign].reset_index(drop=True), int(foreign.sum())


def build_labels(
    sessions: pd.DataFrame,
    signals: pd.DataFrame,
    config: RewardsConfig,
    now: datetime,
    judge_scores: pd.DataFrame | None = None,
) -> LabelSet:
    """All labels for ``sessions`` as of ``now`` (signals whose session is unknown are counted, not used).

    With ``config.require_session_user`` (the default) a signal naming a user other than its
    session's is ignored and counted in ``skipped["foreign_user_signals"]``: only the user a
    session was served to labels it.
    """
    skipped: dict[str, int] = {}
    if config.require_session_user:
        signals, skipped["foreign_user_signals"] = own_user_signals(sessions, signals)
    signals = session_wide(sessions, signals)
    if not signals.empty:
        scoped = signals[
            signals["session_id"].notna() & ~signals["type"].isin(["candidates.shown", "candidate.selected"])
        ]
        skipped["signals_without_session"] = int((~scoped["session_id"].isin(sessions["session_id"])).sum())
    ret, ret_skipped = retention_labels(sessions, signals, config, now)
    skipped.update(ret_skipped)
    labels = ret.copy()
    labels["acceptance"] = acceptance_labels(sessions, signals)
    pairs = selection_pairs(sessions, signals)
    if not pairs.empty:
        wins = pairs.groupby("chosen").size()
        losses = pairs.groupby("rejected").size()
        total = wins.add(losses, fill_value=0)
        labels["selection"] = (wins.reindex(total.index, fill_value=0) / total).reindex(labels.index)
    else:
        labels["selection"] = np.nan
    labels = labels.join(session_signal_labels(sessions, signals, config))
    if judge_scores is not None and not judge_scores.empty:
        labels = labels.join(judge_scores, how="left")
    masked = labels.copy()
    if config.retention_require_final:
        masked.loc[~masked["retention_final"].astype(bool), "retention"] = np.nan
    labels["reward"] = composite(masked.drop(columns=["retention_final", "retention_horizons"]), config.weights)
    bias = position_bias(pairs)
    pairs = pairs.assign(weight=pair_weights(pairs, bias) if config.position_correction else 1.0)
    return LabelSet(sessions=labels, pairs=pairs, skipped=skipped, position=bias)
