"""Labels from signals: horizons, late, repeated and early signals, selections and position bias."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sqlalchemy.engine import Engine

from reward_models.config import RewardsConfig
from reward_models.data import load_sessions, load_signals
from reward_models.labels import build_labels, composite, horizon_weight
from reward_models.synthetic import _env

T0 = datetime(2026, 2, 1, 12, 0, tzinfo=UTC)


def session_event(sid: str, at: datetime = T0, user: str = "u1", **payload: Any) -> dict[str, Any]:
    body = {
        "model": "m",
        "policy_version": "v1",
        "prompt": {"text": "write add"},
        "segments": [
            {
                "role": "assistant",
                "text": "def add(a, b):\n    return a + b\n",
                "token_ids": [1, 2, 3],
                "logprobs": [-0.1, -0.2, -0.3],
            }
        ],
    }
    body.update(payload)
    return _env("session.completed", sid, at, body, user)


def retained(sid: str, horizon: int, kept: int, written: int = 4, at: datetime | None = None) -> dict[str, Any]:
    when = at or T0 + timedelta(seconds=horizon)
    return _env(
        "code.retained", sid, when, {"horizon_s": horizon, "lines_written": written, "lines_retained": kept}, "u1"
    )


def labels_at(engine: Engine, now: datetime, config: RewardsConfig | None = None) -> pd.DataFrame:
    config = config or RewardsConfig()
    return build_labels(load_sessions(engine), load_signals(engine), config, now).sessions


def test_horizon_weights_favor_long_horizons() -> None:
    weights = RewardsConfig().retention_weights
    assert horizon_weight(300, weights) < horizon_weight(3600, weights) < horizon_weight(86400, weights)
    assert horizon_weight(10, weights) == weights[300]
    assert horizon_weight(7200, weights) == weights[3600]


def test_pending_long_horizon_is_not_a_reject(engine: Engine, load_events: Any) -> None:
    load_events(engine, [session_event("s1"), retained("s1", 300, 4), retained("s1", 3600, 4)])
    early = labels_at(engine, T0 + timedelta(hours=2))
    assert early.loc["s1", "retention"] == pytest.approx(
        1.0
    )  # measured horizons only, never a zero for the pending one
    assert not early.loc["s1", "retention_final"]
    assert early.loc["s1", "reward"] == pytest.approx(1.0)  # by default the composite uses what was measured
    waiting = labels_at(engine, T0 + timedelta(hours=2), RewardsConfig(retention_require_final=True))
    assert not waiting.loc["s1", "retention_final"]
    assert np.isnan(waiting.loc["s1", "reward"])  # waiting for the longest horizon: not in the composite yet
    late_no_signal = labels_at(engine, T0 + timedelta(days=1, hours=2))
    assert late_no_signal.loc["s1", "retention_final"]  # horizon and grace elapsed: what was measured is final
    load_events(engine, [retained("s1", 86400, 0)])
    measured = labels_at(engine, T0 + timedelta(hours=2) + timedelta(days=1))
    assert measured.loc["s1", "retention"] == pytest.approx((1.0 + 2.0 * 1.0 + 4.0 * 0.0) / 7.0)
    assert measured.loc["s1", "retention_final"]


def test_late_repeated_and_early_signals_change_only_what_they_should(engine: Engine, load_events: Any) -> None:
    now = T0 + timedelta(days=3)
    # A signal for s2 arrives before its session.
    load_events(engine, [retained("s2", 86400, 1)])
    load_events(engine, [session_event("s1"), session_event("s2"), retained("s1", 86400, 3)])
    before = labels_at(engine, now)
    assert before.loc["s1", "retention"] == pytest.approx(0.75)
    assert before.loc["s2", "retention"] == pytest.approx(0.25)
    # The same event delivered again (same event_id) is a duplicate; stored once.
    again = retained("s1", 86400, 0, at=T0 + timedelta(seconds=86400 + 60))
    assert load_events(engine, [again]) == 1
    assert load_events(engine, [again]) == 0
    # A re-measurement of the same horizon under a new event id: the latest counts, never the sum.
    after = labels_at(engine, now)
    assert after.loc["s1", "retention"] == pytest.approx(0.0)
    assert after.loc["s1", "retention_horizons"] == 1
    # A late signal for s1 changes nothing about s2.
    assert after.loc["s2", "retention"] == before.loc["s2", "retention"]
    assert after.loc["s2", "reward"] == before.loc["s2", "reward"]


def test_acceptance_switch_thumbs_and_churn(sqlite_engine: Engine, load_events: Any) -> None:
    events = [session_event(f"s{i}", T0 + timedelta(minutes=i), user=f"u{i % 2}") for i in range(4)]
    events += [
        _env("edit.accepted", "s0", T0, {"edit_id": "e0"}, None),
        _env("edit.rejected", "s0", T0 + timedelta(seconds=5), {"edit_id": "e0"}, None),  # same edit decided again
        _env("edit.accepted", "s1", T0, {"edit_id": "e1"}, None),
        _env("model.switched", "s2", T0, {"from_model": "m", "to_model": "x"}, None),
        _env("feedback.thumbs", "s3", T0, {"value": -1}, None),
        _env("user.churned", None, T0 + timedelta(days=1), {"inactive_days": 7}, "u1"),
        _env("code.retained", "ghost", T0, {"horizon_s": 300, "lines_written": 2, "lines_retained": 2}, None),
    ]
    load_events(sqlite_engine, events)
    result = build_labels(
        load_sessions(sqlite_engine), load_signals(sqlite_engine), RewardsConfig(), T0 + timedelta(days=5)
    )
    lab = result.sessions
    assert lab.loc["s0", "acceptance"] == 0.0 and lab.loc["s1", "acceptance"] == 1.0
    assert lab.loc["s2", "switch"] == 1.0 and lab.loc["s2", "reward"] == 0.0
    assert lab.loc["s3", "thumbs"] == -1.0
    assert np.isnan(lab.loc["s3", "reward"])  # thumbs weigh 0 by default: no reward from them alone
    assert lab.loc["s1", "churn"] == 1.0 and lab.loc["s3", "churn"] == 1.0 and np.isnan(lab.loc["s0", "churn"])
    assert result.skipped["signals_without_session"] == 1
    with_thumbs = composite(lab[["thumbs"]], {"thumbs": 1.0})
    assert with_thumbs["s3"] == 0.0


def test_selection_pairs_record_position_and_measure_bias(
    sqlite_engine: Engine, synthetic_600: Any, load_events: Any
) -> None:
    events, _ = synthetic_600
    load_events(sqlite_engine, events)
    now = datetime(2026, 2, 1, tzinfo=UTC)
    result = build_labels(load_sessions(sqlite_engine), load_signals(sqlite_engine), RewardsConfig(), now)
    pairs = result.pairs
    assert len(pairs) > 100 and set(pairs["position_source"]) == {"shown"}
    assert (pairs["chosen"] != pairs["rejected"]).all()
    rate = result.position
    # The generator favors the first display slot; the measurement must see it.
    assert rate["rate_by_position"]["0"] > 1.15 > rate["rate_by_position"]["1"]
    first = pairs[pairs["chosen_pos"] == 0]["weight"]
    later = pairs[pairs["chosen_pos"] > 0]["weight"]
    assert first.mean() < 1.0 < later.mean()  # inverse-propensity correction down-weights the favored slot
    no_correction = build_labels(
        load_sessions(sqlite_engine), load_signals(sqlite_engine), RewardsConfig(position_correction=False), now
    )
    assert (no_correction.pairs["weight"] == 1.0).all()


def test_a_signal_for_an_agent_session_reaches_every_turn_and_a_turn_signal_only_its_turn(
    sqlite_engine: Engine, load_events: Any
) -> None:
    turn = {"turn": {"session_id": "agent-1", "index": 0}}
    events = [
        session_event("agent-1.t0", T0, **turn),
        session_event("agent-1.t1", T0 + timedelta(minutes=1), turn={"session_id": "agent-1", "index": 1}),
        session_event("lone", T0),
        retained("agent-1", 300, 3),
        _env("edit.rejected", "agent-1.t1", T0 + timedelta(minutes=2), {"edit_id": "x"}, None),
        _env("edit.accepted", "nobody", T0, {"edit_id": "y"}, None),
    ]
    load_events(sqlite_engine, events)
    sessions = load_sessions(sqlite_engine)
    linked = sessions.set_index("session_id")["agent_session"]
    assert linked["agent-1.t0"] == linked["agent-1.t1"] == "agent-1" and pd.isna(linked["lone"])
    result = build_labels(sessions, load_signals(sqlite_engine), RewardsConfig(), T0 + timedelta(days=9))
    lab = result.sessions
    assert lab.loc["agent-1.t0", "retention"] == 0.75 and lab.loc["agent-1.t1", "retention"] == 0.75
    assert np.isnan(lab.loc["lone", "retention"])
    assert lab.loc["agent-1.t1", "acceptance"] == 0.0 and np.isnan(lab.loc["agent-1.t0", "acceptance"])
    assert result.skipped["signals_without_session"] == 1  # only the signal for a session nobody served
