"""No single user (or a few) can move the reward models much: per-user weight caps, labels only
from a session's own user, and the effect of both on a model attacked by one account."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from reward_models import evaluation as ev
from reward_models.config import RewardsConfig
from reward_models.data import load_sessions, load_signals, session_records, signal_records
from reward_models.labels import build_labels
from reward_models.models import setup_pairwise, setup_pointwise
from reward_models.robust import ANONYMOUS, capped_totals, user_shares, user_weights
from reward_models.synthetic import _env, adversarial_events, foreign_signals, generate_events, synthetic_frame
from reward_models.train import fit_reward_models, train_reward_models

START = datetime(2026, 1, 5, tzinfo=UTC)
SPAN_S = 6 * 86400.0
NOW = START + timedelta(seconds=SPAN_S + 2 * 86400)

# ---------------------------------------------------------------- the weighting (pure function)

users_and_weights = st.integers(1, 200).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 30), min_size=n, max_size=n),
        st.lists(st.floats(0.05, 5.0), min_size=n, max_size=n),
    )
)


@settings(max_examples=200, deadline=None)
@given(users_and_weights, st.floats(0.005, 1.0))
def test_no_user_above_the_cap_and_the_total_is_kept(data: tuple[list[int], list[float]], max_share: float) -> None:
    users = np.array([f"u{u}" for u in data[0]], dtype=object)
    base = np.array(data[1])
    out = user_weights(users, max_share, base)
    cap = max(max_share, 1.0 / len(set(data[0])))
    assert np.all(out > 0) and out.sum() == pytest.approx(base.sum(), rel=1e-9)
    before = user_shares(users, base)
    after = user_shares(users, out).reindex(before.index)
    assert after.max() <= cap + 1e-9  # always feasible: the cap is at least 1 / users
    if before.iloc[0] <= cap:  # nobody over the cap: nothing changes at all
        assert np.array_equal(out, base)
    # Within a user, rows keep their proportions; a heavier user never ends lighter than a lighter one.
    ratio = pd.Series(out / base).groupby(users)
    assert np.allclose(ratio.max(), ratio.min())
    assert np.all(np.diff(after.to_numpy()) <= 1e-12)
    # Users under the level keep their shares relative to one another (only the common rescaling).
    light = after < cap - 1e-9
    if light.sum() > 1:
        scale = (after[light] / before[light]).to_numpy()
        assert np.allclose(scale, scale[0])


@settings(max_examples=100, deadline=None)
@given(users_and_weights, st.floats(0.005, 0.99), st.randoms(use_true_random=False))
def test_weights_are_deterministic_and_follow_the_rows(
    data: tuple[list[int], list[float]], max_share: float, rnd: Any
) -> None:
    users = np.array([f"u{u}" for u in data[0]], dtype=object)
    base = np.array(data[1])
    first = user_weights(users, max_share, base)
    assert np.array_equal(first, user_weights(users.copy(), max_share, base.copy()))
    order = np.array(rnd.sample(range(len(users)), len(users)))
    assert np.allclose(user_weights(users[order], max_share, base[order]), first[order], rtol=1e-12)


def test_one_heavy_user_is_capped_and_everyone_else_keeps_their_proportions() -> None:
    users = np.array(["attacker"] * 600 + [f"u{i % 40}" for i in range(600)], dtype=object)
    out = user_weights(users, 0.05)
    s = user_shares(users, out)
    assert s["attacker"] == pytest.approx(0.05) and s.drop("attacker").max() < 0.05
    assert out.sum() == pytest.approx(1200.0)
    # 5% of 1200 over the attacker's 600 rows, 95% over the honest 600 (equal counts: still equal).
    assert np.allclose(out[:600], 0.1) and np.allclose(out[600:], 1.9)


def test_cap_one_is_off_and_few_users_get_equal_shares() -> None:
    users = np.array(["a"] * 90 + ["b"] * 10, dtype=object)
    assert np.array_equal(user_weights(users, 1.0), np.ones(100))  # the defense turned off
    s = user_shares(users, user_weights(users, 0.05))  # 2 users: the best any cap can do is 1/2 each
    assert s["a"] == pytest.approx(0.5) and s["b"] == pytest.approx(0.5)
    assert np.array_equal(user_weights(np.array(["only"] * 7, dtype=object), 0.01), np.ones(7))
    assert user_weights(np.array([], dtype=object), 0.05).shape == (0,)


def test_rows_without_a_user_are_one_pool_and_bad_input_is_refused() -> None:
    users = np.array([None] * 50 + [np.nan] * 50 + [""] * 20 + [f"u{i}" for i in range(80)], dtype=object)
    s = user_shares(users, user_weights(users, 0.05))
    assert s[ANONYMOUS] == pytest.approx(0.05)  # leaving the user id out does not escape the cap
    with pytest.raises(ValueError, match="base weights"):
        user_weights(np.array(["a", "b"], dtype=object), 0.1, np.ones(3))
    assert np.array_equal(capped_totals(np.array([5.0, 1.0, 1.0]), 1.0), [5.0, 1.0, 1.0])


# ---------------------------------------------------------------- labels from the session's own user

T0 = datetime(2026, 2, 1, 12, 0, tzinfo=UTC)


def _session(sid: str, user: str, group: str | None = None, index: int | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": "m",
        "policy_version": "v1",
        "prompt": {"text": "write add"},
        "segments": [{"role": "assistant", "text": "def add(a, b):\n    return a + b\n", "token_ids": [1]}],
    }
    if group is not None:
        payload["group_id"], payload["candidate_index"] = group, index
    return _env("session.completed", sid, T0, payload, user)


def _retained(sid: str, kept: int, user: str | None, minutes: int = 0) -> list[dict[str, Any]]:
    return [
        _env(
            "code.retained",
            sid,
            T0 + timedelta(seconds=h, minutes=minutes),
            {"horizon_s": h, "lines_written": 4, "lines_retained": kept},
            user,
        )
        for h in (300, 3600, 86400)
    ]


def _foreign_scenario() -> list[dict[str, Any]]:
    """u1's sessions labeled by u1; u2 (the attacker) sends later, opposite signals about them."""
    later = T0 + timedelta(days=1, hours=2)
    events = [_session("s1", "u1", "g1", 0), _session("s2", "u1", "g1", 1), _session("s3", "u1")]
    events += _retained("s1", 4, "u1") + _retained("s3", 0, None)  # s3: signals without a user still count
    events += [
        _env("edit.accepted", "s1", T0 + timedelta(seconds=20), {"edit_id": "e1"}, "u1"),
        _env("feedback.thumbs", "s1", T0 + timedelta(seconds=30), {"value": 1}, "u1"),
        _env("candidates.shown", "s1", T0, {"group_id": "g1", "session_ids": ["s1", "s2"]}, "u1"),
        _env(
            "candidate.selected", "s1", T0 + timedelta(seconds=9), {"group_id": "g1", "chosen_session_id": "s1"}, "u1"
        ),
        _env("user.churned", None, T0 + timedelta(days=2), {"inactive_days": 14}, "u1"),  # user level: kept
    ]
    attack = [
        *_retained("s1", 0, "u2", minutes=120),
        _env("edit.rejected", "s1", later, {"edit_id": "e1"}, "u2"),
        _env("feedback.thumbs", "s1", later, {"value": -1}, "u2"),
        _env("model.switched", "s1", later, {"from_model": "m", "to_model": "x"}, "u2"),
        # a selection naming u1's session as its session, but choosing the other candidate
        _env("candidate.selected", "s1", later, {"group_id": "g1", "chosen_session_id": "s2"}, "u2"),
    ]
    return events + attack


@pytest.mark.parametrize("source", ["frames", "database"])
def test_a_foreign_user_signal_does_not_change_another_users_label(
    source: str, sqlite_engine: Engine, load_events: Any
) -> None:
    events = _foreign_scenario()
    if source == "database":
        load_events(sqlite_engine, events)
        sessions, signals = load_sessions(sqlite_engine), load_signals(sqlite_engine)
    else:
        sessions = session_records([e for e in events if e["type"] == "session.completed"])
        sessions["occurred_at"] = pd.to_datetime(sessions["occurred_at"], utc=True)
        signals = signal_records(events)
    now = T0 + timedelta(days=3)
    defended = build_labels(sessions, signals, RewardsConfig(), now)
    s1 = defended.sessions.loc["s1"]
    assert s1["retention"] == 1.0 and s1["acceptance"] == 1.0 and s1["thumbs"] == 1.0 and np.isnan(s1["switch"])
    assert s1["selection"] == 1.0 and defended.pairs[["chosen", "rejected"]].values.tolist() == [["s1", "s2"]]
    assert defended.skipped["foreign_user_signals"] == 7  # 3 horizons, edit, thumbs, switch, selection
    assert defended.sessions.loc["s3", "retention"] == 0.0  # no user on the signal: current behaviour
    assert defended.sessions.loc["s1", "churn"] == 1.0  # user.churned stays user level

    # The switch off (`rewards.require_session_user = false`): the attacker's later signals win.
    exposed = build_labels(sessions, signals, RewardsConfig(require_session_user=False), now)
    e1 = exposed.sessions.loc["s1"]
    assert e1["retention"] == 0.0 and e1["acceptance"] == 0.0 and e1["thumbs"] == -1.0 and e1["switch"] == 1.0
    assert exposed.pairs[["chosen", "rejected"]].values.tolist() == [["s2", "s1"]]
    assert "foreign_user_signals" not in exposed.skipped


def test_agent_session_signals_are_checked_against_the_turns_user() -> None:
    turns = [_session(f"a1.t{i}", "u1") for i in range(2)]
    for i, ev_ in enumerate(turns):
        ev_["payload"]["turn"] = {"session_id": "a1", "index": i}
    events = turns + _retained("a1", 4, "u1") + _retained("a1", 0, "u9", minutes=30)
    sessions = session_records([e for e in events if e["type"] == "session.completed"])
    labels = build_labels(sessions, signal_records(events), RewardsConfig(), T0 + timedelta(days=3))
    assert labels.sessions["retention"].tolist() == [1.0, 1.0] and labels.skipped["foreign_user_signals"] == 3


# ---------------------------------------------------------------- both backends take the weights


@pytest.mark.parametrize("backend", ["sklearn", "torch"])
def test_both_backends_follow_the_sample_weights(backend: str) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches: more threads only contend
    try:
        _check_backend_follows_weights(backend)
    finally:
        torch.set_num_threads(threads)


def _check_backend_follows_weights(backend: str) -> None:
    frame, y, pairs = synthetic_frame(1200, seed=4)
    config = RewardsConfig(backend=backend, hash_features=1 << 12, torch_epochs=6)
    flipped = np.arange(len(y)) % 2 == 1
    y_attacked = np.where(flipped, 1 - y, y)  # half the rows inverted: only the weights tell which to trust
    trust_honest = np.where(flipped, 0.0, 1.0)
    trust_flipped = 1.0 - trust_honest
    good = setup_pointwise(config).fit(frame, y_attacked, trust_honest).score(frame)
    bad = setup_pointwise(config).fit(frame, y_attacked, trust_flipped).score(frame)
    assert (ev.auc(y, good) or 0) > 0.7 > 0.3 > (ev.auc(y, bad) or 1)

    c, r = pairs["chosen"].to_numpy(), pairs["rejected"].to_numpy()
    swap = np.arange(len(c)) % 2 == 1
    chosen, rejected = np.where(swap, r, c), np.where(swap, c, r)
    good_pairs = setup_pairwise(config).fit(frame, chosen, rejected, np.where(swap, 0.0, 1.0)).score(frame)
    bad_pairs = setup_pairwise(config).fit(frame, chosen, rejected, np.where(swap, 1.0, 0.0)).score(frame)
    assert (ev.pairwise_accuracy(good_pairs[c], good_pairs[r]) or 0) > 0.6
    assert (ev.pairwise_accuracy(bad_pairs[c], bad_pairs[r]) or 1) < 0.4


# ---------------------------------------------------------------- the effect: one account floods inverted labels


def _frames(events: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    return session_records([e for e in events if e["type"] == "session.completed"]), signal_records(events)


@pytest.fixture(scope="module")
def poisoned() -> dict[str, Any]:
    """40 honest users (600 sessions); one account served as many sessions as all of them together,
    inverting every signal about its own, and flipping 30 of the best honest sessions' labels."""
    honest, truth = generate_events(600, seed=11, start=START, span_s=SPAN_S, now=NOW)
    attack, _ = adversarial_events(600, user="mallory", seed=12, start=START, span_s=SPAN_S, now=NOW)
    best = truth.sort_values("utility", ascending=False)["session_id"].head(30).tolist()
    attack += foreign_signals(honest, best, user="mallory", at=NOW - timedelta(hours=1))
    # The clean hold-out: later sessions of 20 other users, labeled by the hidden preference itself.
    later, later_truth = generate_events(1000, seed=13, start=START + timedelta(seconds=SPAN_S), span_s=86400.0)
    held = session_records([e for e in later if e["type"] == "session.completed"])
    held["user_id"] = "other-" + held["user_id"].astype(str)
    return {
        "clean": _frames(honest),
        "attacked": _frames(honest + attack),
        "held": held,
        "y": (later_truth["utility"].to_numpy() > 0).astype(int),
    }


def test_one_account_moves_the_model_only_with_the_defenses_off(poisoned: dict[str, Any]) -> None:
    # A converged learner (more SGD epochs than the default 8), so that the test measures the
    # data and not the SGD noise (about +-0.02 AUC between seeds at this size with 8 epochs).
    on = RewardsConfig(sgd_epochs=120)
    off = on.model_copy(update={"max_user_share": 1.0, "require_session_user": False})
    held, y = poisoned["held"], poisoned["y"]

    def heldout_auc(frames: tuple[pd.DataFrame, pd.DataFrame], config: RewardsConfig) -> tuple[float, Any]:
        fit = fit_reward_models(*frames, config, NOW)
        return ev.auc(y, fit.bundle.score(held)) or 0.0, fit

    clean, _ = heldout_auc(poisoned["clean"], on)
    defended, fit_on = heldout_auc(poisoned["attacked"], on)
    exposed, fit_off = heldout_auc(poisoned["attacked"], off)
    # This scenario over 12 data seeds: defended - clean in [-0.022, +0.011] (mean -0.006), exposed - clean
    # at most -0.36 (the account's inverted labels outweigh the honest ones: AUC far below 0.5).
    assert clean > 0.75
    assert abs(defended - clean) <= 0.03, (clean, defended)
    assert exposed < clean - 0.2, (clean, exposed)
    # What the report says: the account held about half of each head's weight, and now holds the cap.
    for head in ("retention", "acceptance", "selection"):
        cap = fit_on.user_caps[head]
        expected = max(on.max_user_share, 1 / cap["users"])  # the cap, or equal shares when there are few users
        assert cap["top_share_before"] > 0.3 and cap["top_share_after"] == pytest.approx(expected)
        assert fit_off.user_caps[head]["top_share_after"] == fit_off.user_caps[head]["top_share_before"]
    assert fit_on.skipped["foreign_user_signals"] == 30 * 5 and "foreign_user_signals" not in fit_off.skipped


def test_frames_and_database_train_the_same_model(
    sqlite_engine: Engine, synthetic_600: Any, load_events: Any, tmp_path: Path
) -> None:
    events, _ = synthetic_600
    load_events(sqlite_engine, events)
    report = train_reward_models(sqlite_engine, RewardsConfig(), tmp_path, now=NOW)
    fit = fit_reward_models(*_frames(events), RewardsConfig(), NOW)
    for head in ("retention", "acceptance", "selection"):
        assert fit.metrics[head] == pytest.approx(report.metrics[head])
    assert fit.metrics["bundle"]["primary"] == pytest.approx(report.metrics["bundle"]["primary"])
    assert fit.skipped == report.skipped
    for head, cap in fit.user_caps.items():
        assert report.extra["user_caps"][head] == pytest.approx(cap)
