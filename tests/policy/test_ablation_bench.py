"""``benchmarks/ablation.py`` and the switch it compares: ``RewardsConfig.rl_reward`` decides whether
sessions without a label are trained on with the reward model's score; partial signals (a group shown
but not selected, retention not measured yet, thumbs only) are no label, never a negative one; a tiny
closed loop of both arms trains the labels-only arm on labeled sessions only, the assisted arm on
reward-model scores too, from the same first sessions, and stores no true utility."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sqlalchemy.engine import Engine

from benchmarks import ablation
from ingest.db import make_engine, upgrade
from policy.config import PolicyConfig
from policy.production import _reward_groups, rewards_with_source, session_rewards
from reward_models.config import RewardsConfig
from reward_models.data import load_sessions, load_signals
from reward_models.labels import build_labels
from scheduler.demo.population import Signal

WIRE_FIELDS = {
    "candidates.shown": {"group_id", "session_ids"},
    "candidate.selected": {"group_id", "chosen_session_id"},
    "edit.accepted": {"edit_id", "lines"},
    "edit.rejected": {"edit_id", "lines"},
    "code.retained": {"horizon_s", "lines_written", "lines_retained", "final_text"},
    "model.switched": {"from_model", "to_model"},
    "feedback.thumbs": {"value"},
    "user.churned": {"inactive_days"},
}
"""Payload fields of each signal type in the wire contract: all a stored signal may carry."""


def _store(engine: Engine, events: list[dict[str, Any]]) -> None:
    ablation.store(engine, events)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    url = f"sqlite:///{tmp_path / 'undertow.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield url, engine
    engine.dispose()


def _group_events(
    tag: str, user: str = "dev-001", k: int = 4, version: str = "v0000"
) -> tuple[list[dict[str, Any]], list[str]]:
    """``k`` stored candidates of one group, as the benchmark builds them (tokens, logprobs, ids)."""
    from policy.rollouts import Rollout

    ids = [f"s-{tag}-{i}" for i in range(k)]
    at = ablation.T0
    events = []
    for i, sid in enumerate(ids):
        rollout = Rollout(prompt_ids=[0, 5, 6], completion_ids=[7, 8 + i, 0], reward=0.0,
                          served_logprobs=np.array([-0.5, -0.25, -0.1]))  # fmt: skip
        body = "return x" + " + 0" * i
        events.append(ablation.session_event(sid, user, at, version, f"grp-{tag}", i, rollout, "# f\n", body))
    return events, ids


def _signals(tag: str, signals: list[Signal], ids: list[str], user: str = "dev-001") -> list[dict[str, Any]]:
    return [
        ablation.signal_event(s, n, ablation.T0 + timedelta(seconds=s.delay_s), user, f"grp-{tag}", ids)
        for n, s in enumerate(signals)
    ]


def test_partial_signals_are_no_label_and_a_selection_labels_the_whole_group(db: tuple[str, Engine]) -> None:
    _, engine = db
    shown, ids_a = _group_events("a")
    thumbs, ids_b = _group_events("b")
    selected, ids_c = _group_events("c")
    _store(engine, shown + thumbs + selected)
    _store(
        engine,
        _signals("a", [Signal(1.0, "candidates.shown", 0, {})], ids_a)
        + _signals(
            "b",
            [
                Signal(1.0, "candidates.shown", 0, {}),
                Signal(90.0, "feedback.thumbs", 2, {"value": -1}),
                Signal(3700.0, "code.retained", 2, {"horizon_s": 3600, "lines_written": 1, "lines_retained": 0}),
            ],
            ids_b,
        )
        + _signals("c", [Signal(1.0, "candidates.shown", 0, {}), Signal(20.0, "candidate.selected", 1, {})], ids_c),
    )
    now = ablation.T0 + timedelta(hours=2)  # the 1 h horizon measured, the day not yet
    waiting = RewardsConfig(retention_require_final=True)  # labels wait for the longest horizon
    labels = build_labels(load_sessions(engine), load_signals(engine), waiting, now).sessions
    # Shown without a selection: no candidate lost anything.
    assert labels.loc[ids_a, "selection"].isna().all() and labels.loc[ids_a, "reward"].isna().all()
    # Thumbs (weight 0) and a retention whose longest horizon is pending: no reward yet, not a zero.
    assert labels.loc[ids_b[2], "thumbs"] == -1.0 and labels.loc[ids_b[2], "retention"] == 0.0
    assert not labels.loc[ids_b[2], "retention_final"] and labels.loc[ids_b, "reward"].isna().all()
    # A reported selection: the chosen candidate wins, the other three shown with it lose.
    assert labels.loc[ids_c, "reward"].tolist() == [0.0, 1.0, 0.0, 0.0]
    labels_only = waiting.model_copy(update={"rl_reward": "labels"})
    rewards = session_rewards(engine, labels_only, now)
    assert set(rewards) == set(ids_c)
    later = session_rewards(engine, labels_only, now + timedelta(days=1))
    assert later[ids_b[2]] == 0.0  # a day and the grace later, the measured retention is final
    assert not set(later) & set(ids_a)
    # by default the label does not wait: the 1 h retention (nothing kept) is the reward two hours on
    assert session_rewards(engine, RewardsConfig(rl_reward="labels"), now)[ids_b[2]] == 0.0


def _promoted_model(engine: Engine, tmp_path: Path, fresh: int, seed: int) -> tuple[datetime, list[dict[str, Any]]]:
    """A reward model trained and promoted on three days of synthetic telemetry, then ``fresh`` sessions
    served in the hour before ``now`` with no signal yet (not stored). Returns ``now`` and those sessions."""
    from reward_models.synthetic import generate_events
    from reward_models.train import train_reward_models

    events, _ = generate_events(500, seed=3, start=ablation.T0, span_s=3 * 86400.0)
    _store(engine, events)
    now = ablation.T0 + timedelta(days=5)
    assert train_reward_models(engine, RewardsConfig(), tmp_path, now=now).promoted
    fresh_events, _ = generate_events(fresh, seed=seed, start=now - timedelta(hours=1), span_s=600.0, now=now)
    return now, [e for e in fresh_events if e["type"] == "session.completed"]


def test_rl_reward_switch_scores_unlabeled_sessions_only_when_assisted(db: tuple[str, Engine], tmp_path: Path) -> None:
    from reward_models.registry import current_promoted

    _, engine = db
    now, fresh = _promoted_model(engine, tmp_path, fresh=30, seed=11)
    assert current_promoted(engine) is not None
    _store(engine, fresh)  # served, no signal arrived yet
    fresh_ids = {e["session_id"] for e in fresh}
    group_events, group_ids = _group_events("p")  # a group where only the pick's rejection was reported
    _store(engine, group_events)
    _store(engine, _signals("p", [Signal(60.0, "edit.rejected", 1, {"lines": 1})], group_ids))

    assisted = session_rewards(engine, RewardsConfig(), now)
    labels_only = session_rewards(engine, RewardsConfig(rl_reward="labels"), now)
    labeled = build_labels(load_sessions(engine), load_signals(engine), RewardsConfig(), now).sessions["reward"]
    assert set(labels_only) == {str(s) for s, v in labeled.items() if np.isfinite(v)}
    assert not fresh_ids & set(labels_only)
    assert fresh_ids <= set(assisted)
    # every label a labels-only update trains on is kept; only groups nobody labeled are scored, so
    # GRPO never compares a label with a score
    frame = load_sessions(engine)
    group = dict(zip(frame["session_id"].astype(str), _reward_groups(frame), strict=True))
    assert {s: assisted[s] for s in labels_only} == labels_only
    partial = {group[s] for s in group if s not in labels_only}
    mixed = [s for s in labels_only if group[s] in partial]
    assert mixed == [group_ids[1]] and labels_only[group_ids[1]] == 0.0
    assert not {s for s in group_ids if s not in labels_only} & set(assisted)  # they wait for their labels
    scores = [assisted[s] for s in fresh_ids]
    assert all(0.0 < x < 1.0 for x in scores) and len(set(scores)) > 1
    rewards, from_label = rewards_with_source(engine, RewardsConfig(), now)
    assert rewards == assisted and from_label == set(labels_only)
    assert rewards_with_source(engine, RewardsConfig(rl_reward="labels"), now)[1] == set(labels_only)
    # scoring partial groups in full instead: a group labeled in full keeps its labels, the partially
    # labeled one is scored in full (its rejection dropped for the model's scores)
    whole, from_label = rewards_with_source(engine, RewardsConfig(rl_score_partial_groups=True), now)
    full = {s: v for s, v in labels_only.items() if group[s] not in partial}
    assert full and {s: whole[s] for s in full} == full and from_label == set(full)
    assert set(group_ids) <= set(whole) and 0.0 < whole[group_ids[1]] < 1.0


def test_a_pessimistic_reward_lowers_model_scores_by_their_error_and_keeps_labels(
    db: tuple[str, Engine], tmp_path: Path
) -> None:
    """``rl_uncertainty_penalty``: a model-scored session trains on ``sigmoid(score - penalty x error)``,
    the error being the score's spread over the users who trained the model; labels are untouched."""
    from reward_models.api import load_scorer

    _, engine = db
    now, fresh = _promoted_model(engine, tmp_path, fresh=40, seed=12)
    _store(engine, fresh)

    mean = session_rewards(engine, RewardsConfig(rl_uncertainty_penalty=0.0), now)
    low, from_label = rewards_with_source(engine, RewardsConfig(rl_uncertainty_penalty=2.0), now)
    assert session_rewards(engine, RewardsConfig(), now) == low  # pessimistic by default
    labels = session_rewards(engine, RewardsConfig(rl_reward="labels"), now)
    assert from_label == set(labels) and {s: low[s] for s in labels} == labels
    scored = sorted(set(mean) - set(labels))
    assert scored and set(low) == set(mean)
    frame = load_sessions(engine, session_ids=scored)
    score, error = load_scorer(engine).score_with_error(frame)
    assert np.all(error >= 0) and np.mean(error) > 0.01
    expected = 1.0 / (1.0 + np.exp(-(score - 2.0 * error)))
    got = np.array([low[str(s)] for s in frame["session_id"]])
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert all(low[s] <= mean[s] + 1e-12 for s in scored) and sum(low[s] < mean[s] - 1e-6 for s in scored) > 0
    with pytest.raises(ValueError):
        RewardsConfig(rl_uncertainty_penalty=-1.0)


def test_the_update_leaves_out_a_reward_model_the_hacking_guard_flags(db: tuple[str, Engine], tmp_path: Path) -> None:
    """Sessions of a later policy version that the promoted model scores higher but whose code users
    rewrote away: the guard flags the model, so an assisted update trains on labels only and says
    why; with the RL side of the guard off, the same model scores the unlabeled sessions."""
    from policy.production import reward_sources
    from reward_models.api import load_scorer
    from reward_models.synthetic import generate_events

    _, engine = db
    now, fresh = _promoted_model(engine, tmp_path, fresh=30, seed=14)
    _store(engine, fresh)  # served, no signal yet: only a reward model can reward them
    start = now - timedelta(days=1, hours=2)  # after the model's data; every retention horizon has passed
    events, _ = generate_events(240, seed=15, start=start, span_s=3600.0, now=now, group_fraction=0.0)
    served = [e for e in events if e["type"] == "session.completed"]
    frame = pd.DataFrame([{"session_id": e["session_id"], "at": e["occurred_at"]} for e in served])
    scores = load_scorer(engine).score(_session_frames(engine, served))
    ranked = sorted(range(len(served)), key=lambda i: scores[i])
    later = {served[i]["session_id"] for i in ranked[len(ranked) // 2 :]}  # the half the model likes
    later.discard(frame.sort_values("at")["session_id"].iloc[0])  # the earlier version starts first
    for event in events:
        sid = event.get("session_id")
        if event["type"] == "session.completed":
            event["payload"]["policy_version"] = "v0002" if sid in later else "v0001"
        elif event["type"] == "code.retained":  # the later version's code is rewritten away
            written = event["payload"]["lines_written"]
            event["payload"]["lines_retained"] = 0 if sid in later else written
            event["payload"]["final_text"] = "" if sid in later else event["payload"].get("final_text")
    _store(engine, [e for e in events if e["type"] in ("session.completed", "code.retained")])

    flagged = reward_sources(engine, RewardsConfig(), now)
    assert flagged.guard is not None and flagged.guard.flagged, flagged.guard
    assert "standard errors" in flagged.guard.reason and flagged.guard.reason.endswith("to v0002")
    assert flagged.labeled == set(flagged.rewards)  # labels only
    assert not {e["session_id"] for e in fresh} & set(flagged.rewards)
    trusted = reward_sources(engine, RewardsConfig(rl_hacking_guard_z=0.0), now)
    assert trusted.guard is None and {e["session_id"] for e in fresh} <= set(trusted.rewards)
    assert {s: trusted.rewards[s] for s in flagged.rewards} == flagged.rewards


def _session_frames(engine: Engine, served: list[dict[str, Any]]) -> pd.DataFrame:
    """Stored-session frames of ``served`` (stored in a scratch database, in ``served``'s order)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        url = f"sqlite:///{Path(scratch) / 'scratch.db'}"
        upgrade(url)
        other = make_engine(url)
        _store(other, served)
        frame = load_sessions(other).set_index("session_id").loc[[e["session_id"] for e in served]].reset_index()
        other.dispose()
    return frame


def _sharper_twin(event: dict[str, Any]) -> dict[str, Any]:
    """The same answer (text and tokens) served by a more confident policy, as another session."""
    twin = json.loads(json.dumps(event))
    twin["event_id"], twin["session_id"] = f"{event['event_id']}-twin", f"{event['session_id']}-twin"
    for segment in twin["payload"]["segments"]:
        if segment.get("logprobs"):
            segment["logprobs"] = [x * 0.1 for x in segment["logprobs"]]
    return twin


def _logprobs(event: dict[str, Any]) -> list[float]:
    """The token logprobs an event carries (a positive one makes the session's summary unknown)."""
    return [x for segment in event["payload"]["segments"] for x in segment.get("logprobs") or []]


def test_hiding_confidence_from_the_reward_model(db: tuple[str, Engine], tmp_path: Path) -> None:
    """The promoted model scores served logprobs (they predict keeps on this data): shown (the default),
    an answer served more confidently earns more; hidden, the text alone decides and it earns the same.
    The mean score (no pessimism: a sharper twin's confidence may leave the labeled range, which the
    score's error sees; ``test_score_error`` covers that)."""
    _, engine = db
    now, fresh = _promoted_model(engine, tmp_path, fresh=30, seed=11)
    _store(engine, fresh + [_sharper_twin(e) for e in fresh])
    pairs = [(e["session_id"], f"{e['session_id']}-twin") for e in fresh]

    mean = RewardsConfig(rl_uncertainty_penalty=0.0)
    hidden = session_rewards(engine, mean.model_copy(update={"rl_score_confidence": False}), now)
    assert all(hidden[a] == pytest.approx(hidden[b], abs=1e-12) for a, b in pairs)
    assert len({round(hidden[a], 9) for a, _ in pairs}) > 1  # the text still ranks them
    shown = session_rewards(engine, mean, now)
    served = [(a, b) for (a, b), e in zip(pairs, fresh, strict=True) if _logprobs(e) and max(_logprobs(e)) <= 0]
    assert served and all(shown[b] > shown[a] for a, b in served)
    assert {s: shown[s] for s in shown if s not in dict(pairs) and not s.endswith("-twin")} == {
        s: hidden[s] for s in hidden if s not in dict(pairs) and not s.endswith("-twin")
    }  # labels are labels either way


def _drift(model: Any, reference: Any, sequences: list[tuple[list[int], int]]) -> float:
    """Mean absolute logprob difference of ``model`` from ``reference`` over the completion tokens."""
    import torch

    from policy.forward import forward_tokens

    with torch.no_grad():
        gaps = [
            (forward_tokens(model, ids, prompt_len=n).logprobs - forward_tokens(reference, ids, prompt_len=n).logprobs)
            .abs()
            .mean()
            for ids, n in sequences
        ]
    return float(torch.stack(gaps).mean())


def _tiny_v0(engine: Engine, tmp_path: Path) -> Path:
    """A tiny untrained policy recorded as v0000; its checkpoint directory."""
    from policy.model import build_model, save_checkpoint
    from policy.tokenizer import default_tokenizer
    from policy.versions import record_version

    tokenizer = default_tokenizer()
    v0 = save_checkpoint(build_model("tiny", len(tokenizer), seed=0), tokenizer, tmp_path / "v0")
    record_version(engine, version="v0000", parent=None, step=0, checkpoint_path=v0, metrics={})
    return Path(v0)


def _picked_groups(
    engine: Engine, labeled: str, tags: str = "abcd", served_by: dict[str, str] | None = None
) -> dict[str, list[str]]:
    """A stored group of four per tag (served by v0000 unless ``served_by`` names another version); the
    user picked one of each group whose tag is in ``labeled``."""
    groups = {}
    for tag in tags:
        events, ids = _group_events(tag, version=(served_by or {}).get(tag, "v0000"))
        _store(engine, events)
        if tag in labeled:
            picked = [Signal(1.0, "candidates.shown", 0, {}), Signal(20.0, "candidate.selected", 1, {})]
            _store(engine, _signals(tag, picked, ids))
        groups[tag] = ids
    return groups


def test_an_update_says_which_reward_model_scored_its_sessions(db: tuple[str, Engine], tmp_path: Path) -> None:
    """The version's metrics count the sessions the promoted model scored and name that model (the
    demo's table and the API read them); a labels-only update names none and counts none."""
    from policy.production import ProductionSession, TrainRequest
    from reward_models.registry import current_promoted

    url, engine = db
    _promoted_model(engine, tmp_path, fresh=1, seed=13)
    promoted = current_promoted(engine)
    assert promoted is not None
    _tiny_v0(engine, tmp_path)
    groups = _picked_groups(engine, labeled="ab")  # nobody judged c and d yet
    unlabeled = groups["c"] + groups["d"]
    request = TrainRequest(base_version="v0000", steps=4, lr=1e-4, groups_per_step=2, eval=dict(ablation.NO_EVAL))
    request = replace(request, now=ablation.T0 + timedelta(hours=1))
    metrics = {}
    for source in ("assisted", "labels"):
        rewards = RewardsConfig(rl_reward=source)
        session = ProductionSession(PolicyConfig(), rewards, url, tmp_path / f"home-{source}", request)
        while not session.done:
            session.step()
        metrics[source] = session.result()["metrics"]
    assert metrics["assisted"]["batch/sessions"] == 16 and metrics["assisted"]["batch/model_scored"] == len(unlabeled)
    assert metrics["assisted"]["reward/model"] == promoted.version
    assert metrics["labels"]["batch/sessions"] == 8 and metrics["labels"]["batch/model_scored"] == 0
    assert "reward/model" not in metrics["labels"]


def test_the_kl_term_keeps_an_update_near_its_reference(db: tuple[str, Engine], tmp_path: Path) -> None:
    """Production updates with ``kl_coef`` train against the base version's logprobs: from the same data,
    seed and (large) learning rate, a strong KL leaves the policy far closer to v0 than none does."""
    from policy.config import PolicyConfig
    from policy.model import load_checkpoint
    from policy.production import ProductionSession, TrainRequest

    url, engine = db
    v0 = _tiny_v0(engine, tmp_path)
    groups = _picked_groups(engine, labeled="abcd")
    sequences = [([0, 5, 6, 7, 8 + i, 0], 3) for ids in groups.values() for i in range(len(ids))]
    request = TrainRequest(base_version="v0000", steps=4, lr=0.02, groups_per_step=2, eval=dict(ablation.NO_EVAL))
    request = replace(request, now=ablation.T0 + timedelta(hours=1))
    reference, _ = load_checkpoint(v0)
    drift = {}
    for kl in (0.0, 50.0):
        session = ProductionSession(PolicyConfig(kl_coef=kl), RewardsConfig(), url, tmp_path / "home", request)
        while not session.done:
            session.step()
        result = session.result()
        assert result["version"] != "v0000" and session.step_no == 4
        drift[kl] = _drift(session.model, reference, sequences)
        if kl:
            assert result["metrics"]["train/kl_reference"] == "v0000" and result["metrics"]["train/kl"] > 0
        else:
            assert "train/kl" not in result["metrics"]
    assert drift[0.0] > 0.05  # the update moved the policy
    assert drift[50.0] < 0.5 * drift[0.0]


def test_reward_quality_measures_agreement_with_the_true_utility() -> None:
    records = [
        ("g1", "label", 1.0, 0.9),
        ("g1", "label", 0.0, 0.1),
        ("g1", "label", 0.0, 0.1),  # equal utility: no pair with the one before
        ("g2", "reward_model", 0.2, 1.0),
        ("g2", "reward_model", 0.8, 0.0),
        ("g3", "reward_model", 0.5, 1.0),
        ("g3", "reward_model", 0.5, 0.0),
    ]
    quality = ablation.reward_quality(records)
    assert quality["label"]["pairs"] == 2 and quality["label"]["pairwise_agreement"] == 1.0
    assert quality["label"]["pearson"] == pytest.approx(1.0)
    assert quality["reward_model"]["pairs"] == 2
    assert quality["reward_model"]["pairwise_agreement"] == pytest.approx(0.25)  # one reversed, one tie
    pearson = quality["reward_model"]["pearson"]
    assert pearson is not None and pearson < 0
    mixed = ablation.mixed_groups([*records, ("g3", "label", 1.0, 1.0)])
    assert mixed == {"groups": 3, "mixed": 1, "share": pytest.approx(1 / 3)}


def test_advantage_alignment_finds_the_push_on_groups_with_no_true_winner() -> None:
    right = [("0/a", "m", 0.9, 1.0), ("0/a", "m", 0.1, 0.0)]  # a real winner, ordered right
    tie = [("0/b", "m", 0.51, 0.4), ("0/b", "m", 0.49, 0.4)]  # equal true utility, a near tie in reward
    alone = [("0/c", "m", 0.3, 1.0)]  # no group to compare with: left out
    grpo = ablation.advantage_alignment(right + tie + alone, "grpo")
    assert grpo["groups"] == 2 and grpo["tied_groups_share"] == 0.5
    # per-group scaling gives the tie's 0.02 gap as much push as the winner's 0.8 lead
    assert grpo["advantage_on_tied_groups"] == pytest.approx(0.5, abs=0.01)
    assert grpo["advantage_cosine"] == pytest.approx(math.sqrt(0.5), abs=0.01)
    batch = ablation.advantage_alignment(right + tie + alone, "grpo_batch")
    assert batch["advantage_on_tied_groups"] == pytest.approx(0.02**2 / (0.8**2 + 0.02**2), rel=1e-3)
    assert batch["advantage_cosine"] > 0.99
    wrong = ablation.advantage_alignment([("0/a", "m", 0.1, 1.0), ("0/a", "m", 0.9, 0.0)], "grpo")
    assert wrong["advantage_cosine"] == pytest.approx(-1.0) and wrong["tied_groups_share"] == 0.0
    assert ablation.advantage_alignment(alone)["advantage_cosine"] is None


def test_the_noisy_truth_control_keeps_labels_and_hits_its_correlation() -> None:
    import random

    gen = np.random.default_rng(0)
    truth = {f"s{i}": float(u) for i, u in enumerate(gen.uniform(0, 1, 4000))}
    ids = list(truth)
    plan = [[(sid, -1.0) for sid in ids[at : at + 8]] for at in range(0, len(ids), 8)]
    labeled = set(ids[:400])
    out = ablation.noisy_truth(plan, labeled, truth, 0.5, random.Random(1))
    assert [[sid for sid, _ in b] for b in out] == [[sid for sid, _ in b] for b in plan]  # same sessions, order
    rewards = {sid: r for b in out for sid, r in b}
    assert all(rewards[sid] == -1.0 for sid in labeled)  # a label stays the label
    scored = [sid for sid in ids if sid not in labeled]
    r = np.corrcoef([rewards[s] for s in scored], [truth[s] for s in scored])[0, 1]
    assert r == pytest.approx(0.5, abs=0.04)
    again = ablation.noisy_truth(plan, labeled, truth, 0.5, random.Random(2))
    assert [r for b in again for _, r in b] != [r for b in out for _, r in b]  # the error is drawn anew
    exact = ablation.noisy_truth(plan, labeled, truth, 1.0, random.Random(1))
    assert all(r == truth[sid] for b in exact for sid, r in b if sid not in labeled)
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit, match="noisy-truth"):
            ablation.parse_args(["--noisy-truth", bad])


def _rows(path: Path, query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(query).fetchall()


@pytest.mark.slow
def test_a_tiny_closed_loop_of_both_arms(tmp_path: Path) -> None:
    cfg = ablation.AblationConfig(
        seeds=(0,), rounds=2, groups=32, steps=2, groups_per_step=4, sft_steps=200,
        eval_per_tier=4, eval_samples=2, rm_min_new_labels=10, workers=1,
        labels_first=False,  # 8 draws an update: with the labels first, the model would fill none
    )  # fmt: skip
    keep = tmp_path / "runs"
    out = ablation.run(cfg, None, tmp_path / "home", keep)
    json.dumps(out)  # one JSON object

    arms = out["arms"]
    assert set(arms) == {"assisted", "labels"}
    v0 = out["v0"]["utility"][0]
    for summary in arms.values():
        run = summary["runs"][0]
        assert summary["gain_points"]["per_seed"][0] == pytest.approx(100 * (run["utility"] - v0))
        assert summary["updates"] + summary["updates_skipped"] == cfg.rounds
        assert summary["trained_sessions"] == sum(r.get("trained_sessions", 0) for r in run["rounds"])
        assert 0.0 <= summary["keep_rate"][0] <= summary["pass_rate"][0] <= 1.0
    diff = out["difference_points"]["per_seed"][0]
    assert diff == pytest.approx(
        arms["assisted"]["gain_points"]["per_seed"][0] - arms["labels"]["gain_points"]["per_seed"][0]
    )
    assert out["verdict"]["assisted_beats_labels_by_more_than_spread"] is False  # one seed has no spread
    assert out["conditions"]["seeds"] == [0] and out["conditions"]["rounds"] == 2

    labels_rounds = arms["labels"]["runs"][0]["rounds"]
    assert all(r["from_reward_model"] == 0 for r in labels_rounds if not r["skipped"])
    assert arms["labels"]["reward_source"]["reward_model"] == 0 and arms["labels"]["reward_models"]["trained"] == 0
    assert arms["assisted"]["reward_models"]["promoted"] >= 1
    assert arms["assisted"]["reward_source"]["reward_model"] > 0  # fresh sessions scored by the promoted model
    assert math.isfinite(arms["assisted"]["reward_quality"]["reward_model"]["pearson_mean_over_seeds"])
    assert arms["labels"]["groups_mixing_sources"]["mixed"] == 0

    dbs = {arm: keep / f"{arm}-seed0" / "undertow.db" for arm in ablation.ARMS}
    first = {
        arm: _rows(path, "SELECT session_id, completion_text FROM sessions WHERE policy_version = 'v0000' ORDER BY 1")
        for arm, path in dbs.items()
    }
    assert first["assisted"] == first["labels"] and len(first["labels"]) == cfg.groups * cfg.k  # same first round
    for path in dbs.values():
        for kind, payload in _rows(path, "SELECT type, payload FROM signals"):
            assert set(json.loads(payload)) <= WIRE_FIELDS[kind], (kind, payload)
        with sqlite3.connect(path) as conn:
            dump = "\n".join(conn.iterdump())
        assert "utility" not in dump.lower()


def test_best_of_group_rewards_the_models_pick_like_a_selection() -> None:
    from policy.production import _best_of_group

    keys = np.array(["g1", "g1", "g1", "solo", "g2", "g2"])
    scores = np.array([0.2, 1.5, -0.3, 0.4, 0.7, 0.7])
    probability = 1.0 / (1.0 + np.exp(-scores))
    out = _best_of_group(keys, scores, probability)
    assert out.tolist()[:3] == [0.0, 1.0, 0.0]  # the model's top pick wins its group
    assert out[3] == probability[3]  # a session alone keeps its calibrated probability
    assert out.tolist()[4:] == [1.0, 0.0]  # a tie goes to the first, exactly one winner per group


def test_command_line_overrides_population_knobs_and_refuses_bad_ones() -> None:
    cfg, _ = ablation.parse_args(["--population", "select_rate=0.2", "--population", "users=12", "--no-labels-first"])
    assert cfg.population == (("select_rate", 0.2), ("users", 12)) and not cfg.labels_first
    population = ablation.make_population(cfg, 0)
    assert population.config.select_rate == 0.2 and len(population.users) == 12
    for bad in ("select_rate", "nosuch=1", "select_rate=high", "users=1.5", "switch_targets=1"):
        with pytest.raises(SystemExit, match="--population"):
            ablation.parse_args(["--population", bad])
    with pytest.raises(ValueError, match="select_rate must be in"):  # the population's own validation
        ablation.make_population(ablation.parse_args(["--population", "select_rate=2"])[0], 0)


def test_one_arm_alone_runs_without_a_verdict_and_bad_arms_are_refused() -> None:
    assert ablation.parse_args([])[0].arms == ("assisted", "labels")
    assert ablation.parse_args(["--arms", "assisted"])[0].arms == ("assisted",)
    for bad in ("", "assisted,assisted", "labels,model", "all"):
        with pytest.raises(SystemExit, match="--arms"):
            ablation.parse_args(["--arms", bad])
    gains = {"assisted": [3.0, 1.0, 2.0], "labels": [1.0, 2.0, -1.0]}
    arms = {a: {"gain_points": {**ablation.spread(g), "per_seed": dict(enumerate(g))}} for a, g in gains.items()}
    both = ablation._verdict(arms, (0, 1, 2))
    assert both["difference_points"]["per_seed"] == {0: 2.0, 1: -1.0, 2: 3.0}
    assert both["verdict"]["assisted_beats_labels_by_more_than_spread"] is False  # +1.33 < the larger std 1.53
    assert ablation._verdict({"assisted": arms["assisted"]}, (0, 1, 2)) == {"difference_points": None, "verdict": None}
    penalty = ablation.parse_args(["--rewards", "rl_uncertainty_penalty=1.5"])[0]
    assert ablation.rewards_config(penalty, "assisted").rl_uncertainty_penalty == 1.5
    with pytest.raises(SystemExit, match="--rewards"):
        ablation.parse_args(["--rewards", "rl_uncertainty_penalty=-1"])


def test_rewards_overrides_reach_both_arms_labels(db: tuple[str, Engine]) -> None:
    """``--rewards retention_require_final=true``: a session whose only label is its 1 h retention has no
    reward two hours on in either arm (labels wait a day for the longest horizon); by default it has."""
    _, engine = db
    events, ids = _group_events("r")
    kept = [Signal(3700.0, "code.retained", i, {"horizon_s": 3600, "lines_written": 4, "lines_retained": 4 - i})
            for i in range(4)]  # fmt: skip
    _store(engine, events + _signals("r", kept, ids))
    now = ablation.T0 + timedelta(hours=2)
    cfg, _ = ablation.parse_args(["--rewards", "retention_require_final=true", "--rewards", "min_train_rows=5"])
    assert cfg.rewards == (("retention_require_final", True), ("min_train_rows", 5))
    for arm in ablation.ARMS:
        rewards = ablation.rewards_config(cfg, arm)
        assert rewards.rl_reward == arm and rewards.min_train_rows == 5
        assert session_rewards(engine, rewards, now) == {}
        got = session_rewards(engine, ablation.rewards_config(ablation.parse_args([])[0], arm), now)
        assert sorted(got) == ids and got[ids[0]] > got[ids[1]] > got[ids[3]]
    for bad in ("retention_require_final=maybe", "nosuch=1", "min_train_rows=two", "rl_reward=labels", "weights"):
        with pytest.raises(SystemExit, match="--rewards"):
            ablation.parse_args(["--rewards", bad])
    # out of its range: refused while parsing, before any work
    with pytest.raises(SystemExit, match="--rewards: min_train_rows: Input should be greater than or equal to 2"):
        ablation.parse_args(["--rewards", "min_train_rows=1"])
    # a setting another option gives: the override wins instead of a clash
    cfg, _ = ablation.parse_args(["--rm-min-new-labels", "50", "--rewards", "retrain_min_new_labels=7"])
    assert ablation.rewards_config(cfg, "assisted").retrain_min_new_labels == 7


def test_max_staleness_decides_whether_an_update_waits_for_old_labels(db: tuple[str, Engine], tmp_path: Path) -> None:
    """``--max-staleness``: labeled groups served by v0 reach an update from v3 only when the limit
    is 3 or more (the baseline that trains on late labels off-policy); under it the update has none."""
    from policy.production import ProductionSession, TrainRequest
    from policy.versions import record_version

    url, engine = db
    ckpt = _tiny_v0(engine, tmp_path)
    for n in range(1, 4):
        record_version(engine, version=f"v000{n}", parent=f"v000{n - 1}", step=n, checkpoint_path=ckpt, metrics={})
    _picked_groups(engine, labeled="ab", tags="ab")  # served by v0000
    request = TrainRequest(base_version="v0003", steps=1, groups_per_step=2, eval=dict(ablation.NO_EVAL))
    request = replace(request, now=ablation.T0 + timedelta(hours=1))
    labels_only = RewardsConfig(rl_reward="labels")

    def update(limit: int) -> ProductionSession:
        cfg, _ = ablation.parse_args(["--max-staleness", str(limit)])
        return ProductionSession(ablation.policy_config(cfg, 0), labels_only, url, tmp_path / "home", request)

    with pytest.raises(RuntimeError, match="no rewarded session"):
        update(2)
    waiting = update(3)
    assert {sid for batch in waiting.plan for sid, _ in batch} == {f"s-{t}-{i}" for t in "ab" for i in range(4)}
    assert ablation.policy_config(ablation.parse_args([])[0], 0).max_staleness == PolicyConfig().max_staleness


def test_an_update_leaves_out_the_sessions_of_a_version_rolled_back_beside_its_line(
    db: tuple[str, Engine], tmp_path: Path
) -> None:
    """v0001 was rolled back and v0002 trained from v0000 instead: an update from v0002 trains on the
    sessions of v0002 and v0000, not on those v0001 served (within the staleness limit, but off the
    line the policy follows), and its metrics count them; ``rl_lineage_only = False`` takes them."""
    from policy.production import ProductionSession, TrainRequest
    from policy.versions import lineage, record_version

    url, engine = db
    ckpt = _tiny_v0(engine, tmp_path)
    record_version(engine, version="v0001", parent="v0000", step=1, checkpoint_path=ckpt, metrics={})
    record_version(engine, version="v0002", parent="v0000", step=1, checkpoint_path=ckpt, metrics={})
    assert lineage(engine, "v0002") == ["v0002", "v0000"] and lineage(engine, "v0001") == ["v0001", "v0000"]
    groups = _picked_groups(engine, labeled="abc", tags="abc", served_by={"a": "v0001", "b": "v0002"})
    request = TrainRequest(base_version="v0002", steps=4, groups_per_step=3, eval=dict(ablation.NO_EVAL))
    request = replace(request, now=ablation.T0 + timedelta(hours=1))
    labels_only = RewardsConfig(rl_reward="labels")

    def trained(cfg: PolicyConfig) -> tuple[set[str], ProductionSession]:
        session = ProductionSession(cfg, labels_only, url, tmp_path / "home", request)
        return {sid for batch in session.plan for sid, _ in batch}, session

    on_line, session = trained(PolicyConfig(max_staleness=4))
    assert on_line == set(groups["b"]) | set(groups["c"])
    assert session.stale.off_lineage == 4 and session.stale.dropped == 4
    every, session = trained(PolicyConfig(max_staleness=4, rl_lineage_only=False))
    assert every == set(groups["a"]) | set(groups["b"]) | set(groups["c"]) and session.stale.off_lineage == 0
