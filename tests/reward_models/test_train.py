"""Training from the database: the models recover the generator's hidden preference, the registry
promotes only a better version, and bad data gives clear errors or counted skips."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from ingest.tables import SessionRow
from reward_models import registry
from reward_models.api import load_scorer, score_sessions
from reward_models.config import RewardsConfig
from reward_models.models import RewardBundle
from reward_models.synthetic import generate_events
from reward_models.tables import RewardModelRow
from reward_models.train import TrainingDataError, train_reward_models

START = datetime(2026, 1, 5, tzinfo=UTC)
NOW = START + timedelta(days=8)


def test_models_recover_hidden_preference_and_registry_promotes_only_better(
    sqlite_engine: Engine, synthetic_600: Any, load_events: Any, tmp_path: Path
) -> None:
    events, truth = synthetic_600
    load_events(sqlite_engine, events)
    report = train_reward_models(sqlite_engine, RewardsConfig(), tmp_path, now=NOW)
    m = report.metrics
    # Stated thresholds: held-out AUC and pairwise accuracy well above the trivial baseline (0.5).
    assert m["retention"]["auc"] > 0.72 > m["retention"]["auc_baseline"] + 0.2
    assert m["selection"]["pairwise_acc"] > 0.65
    assert m["bundle"]["composite_auc"] > 0.72
    assert m["retention"]["auc"] > m["retention"]["auc_logprob"]  # better than the policy's own confidence
    assert m["privileged"]["auc"] > m["retention"]["auc"]  # seeing what the user kept makes labeling easier
    assert report.status == registry.PROMOTED and report.to_json()["versions"] == [report.version]
    assert report.coverage["thumbs"]["weight"] == 0.0 and report.coverage["retention"]["fraction"] > 0.9

    # The scorer ranks correct, concise answers above buggy or padded ones (the hidden preference).
    scorer = load_scorer(sqlite_engine, "latest")
    good = {
        "prompt": "Write a Python function add(a, b) that returns the sum of a and b.",
        "completion": "def add(a, b):\n    return a + b\n",
    }
    padded = dict(
        good,
        completion="def add(a, b):\n    # compute the result step by step\n    result = None\n"
        "    value = 0\n    return a + b\n",
    )
    buggy = dict(good, completion="def add(a, b):\n    return None\n")
    s_good, s_padded, s_buggy = scorer.score([good, padded, buggy])
    assert s_good > s_padded and s_good > s_buggy
    by_id = score_sessions(sqlite_engine, [*list(truth["session_id"][:50]), "missing"])
    assert len(by_id) == 50 and "missing" not in by_id
    corr = np.corrcoef([by_id[s] for s in truth["session_id"][:50]], truth["utility"][:50])[0, 1]
    assert corr > 0.4

    # Retraining on the same data cannot beat the current version on the same hold-out: kept as candidate.
    second = train_reward_models(sqlite_engine, RewardsConfig(), tmp_path, now=NOW)
    assert second.status == registry.CANDIDATE and "does not beat" in second.reason
    assert second.current_version == report.version
    assert load_scorer(sqlite_engine).version == report.version
    rows = registry.list_versions(sqlite_engine)
    assert [r["version"] for r in rows] == [second.version, report.version]

    # A tampered artifact never scores.
    row = registry.get_version(sqlite_engine, report.version)
    Path(row.artifact_path).write_bytes(b"not a model")
    with pytest.raises(registry.CorruptArtifact):
        load_scorer(sqlite_engine, report.version)
    with pytest.raises(registry.UnknownVersion, match="rewards list"):
        load_scorer(sqlite_engine, "rm-9999-nothere")


def test_torch_backend_trains_and_registers(
    sqlite_engine: Engine, synthetic_600: Any, load_events: Any, tmp_path: Path
) -> None:
    import torch

    torch.set_num_threads(1)
    events, _ = synthetic_600
    load_events(sqlite_engine, events)
    report = train_reward_models(sqlite_engine, RewardsConfig(backend="torch", bt_margin=0.1), tmp_path, now=NOW)
    assert report.metrics["retention"]["auc"] > 0.65
    assert report.metrics["selection"]["pairwise_acc"] > 0.6
    with transaction(sqlite_engine) as session:
        assert session.get(RewardModelRow, report.version).backend == "torch"
    assert np.all(np.isfinite(load_scorer(sqlite_engine, report.version).score([{"prompt": "x", "completion": "y"}])))


def test_empty_window_is_a_clear_error(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(TrainingDataError, match="undertow ingest"):
        train_reward_models(engine, RewardsConfig(), tmp_path, now=NOW)


def test_single_class_and_missing_text_never_promote_a_bad_model(
    sqlite_engine: Engine, load_events: Any, tmp_path: Path
) -> None:
    events, _ = generate_events(120, seed=3, start=START, span_s=5 * 86400, now=NOW, group_fraction=0.0)
    kept = []
    for ev in events:
        if ev["type"] == "code.retained":  # every user keeps everything: a single class
            ev["payload"]["lines_retained"] = ev["payload"]["lines_written"]
        if ev["type"] in ("edit.accepted", "edit.rejected", "model.switched"):
            continue
        kept.append(ev)
    for ev in kept[:30]:
        if ev["type"] == "session.completed":  # sessions without text and with NaN-free but absent logprobs
            ev["payload"]["segments"] = [{"role": "assistant", "token_ids": [1, 2]}]
    load_events(sqlite_engine, kept)
    with pytest.raises(TrainingDataError, match="single class"):
        train_reward_models(sqlite_engine, RewardsConfig(), tmp_path, now=NOW)
    assert registry.current_promoted(sqlite_engine) is None
    with transaction(sqlite_engine) as session:
        assert session.execute(select(RewardModelRow)).first() is None


def test_bad_rows_are_skipped_with_counts_and_weak_models_stay_candidates(
    sqlite_engine: Engine, load_events: Any, tmp_path: Path
) -> None:
    events, _ = generate_events(300, seed=5, start=START, span_s=5 * 86400, now=NOW)
    rng = np.random.default_rng(0)
    for ev in events:
        if ev["type"] == "code.retained":  # labels unrelated to the text: nothing to learn
            ev["payload"]["lines_retained"] = int(rng.integers(0, ev["payload"]["lines_written"] + 1))
        if ev["type"] in ("edit.accepted", "edit.rejected", "candidate.selected", "candidates.shown", "model.switched"):
            ev["type"] = "feedback.thumbs"
            ev["payload"] = {"value": 1}
    blank = [e for e in events if e["type"] == "session.completed"][:10]
    for ev in blank:
        ev["payload"]["segments"] = [{"role": "assistant", "text": "   "}]
    load_events(sqlite_engine, events)
    with transaction(
        sqlite_engine
    ) as session:  # a NaN logprob can only come from storage; the model must not see it raw
        row = session.execute(select(SessionRow).where(SessionRow.session_id == "s-5-000100")).scalar_one()
        row.segments[-1].logprobs = np.array([np.nan, -0.1]).tobytes()
    report = train_reward_models(sqlite_engine, RewardsConfig(min_auc_over_baseline=0.1), tmp_path, now=NOW)
    assert report.skipped["sessions_without_text"] == 10
    assert report.skipped["sessions_missing_logprob"] >= 1
    assert "selection" in report.skipped_heads and "acceptance" in report.skipped_heads
    assert report.status == registry.CANDIDATE and "baseline" in report.reason
    assert registry.current_promoted(sqlite_engine) is None


def test_a_bundle_that_ranks_no_better_than_chance_is_never_promoted() -> None:
    """Each head over its baseline on a small hold-out, but their combination (what RL trains on)
    below chance: the first version too stays a candidate (the demo's population once promoted one at 0.447)."""
    from reward_models.train import _decide

    heads = {"acceptance": object()}
    config = RewardsConfig()

    def metrics(primary: float) -> dict[str, Any]:
        return {
            "bundle": {"finite": True, "primary": primary},
            "acceptance": {"auc": 0.7, "auc_baseline": 0.5},
        }

    status, reason = _decide(metrics(0.447), heads, None, None, config)
    assert status == registry.CANDIDATE and "chance" in reason
    status, reason = _decide(metrics(0.5 + config.min_auc_over_baseline + 0.01), heads, None, None, config)
    assert status == registry.PROMOTED and "first version" in reason


def test_a_head_refuses_a_version_only_on_a_hold_out_large_enough_to_tell() -> None:
    """The demo's selection head was checked on 4 to 15 hold-out pairs and refused three of four
    versions (0.125 on 4 pairs, 0.500 on 6) whose acceptance head ranked its hold-out perfectly. A head
    under its baseline on fewer observations than ``head_check_min_evidence`` is left unjudged, and the
    bundle's checks decide; on enough it still refuses, and a bundle under chance is still refused."""
    from reward_models.train import _decide

    heads = {"acceptance": object(), "selection": object()}
    config = RewardsConfig()

    def metrics(
        pairwise: float | None,
        pairs: int,
        auc: float | None = 0.95,
        n: int = 60,
        rate: float | None = 0.4,
        primary: float = 0.8,
    ):
        return {
            "bundle": {"finite": True, "primary": primary},
            "acceptance": {"auc": auc, "auc_baseline": 0.5, "n": n, "positive_rate": rate},
            "selection": {"pairwise_acc": pairwise, "pairwise_acc_baseline": 0.5, "pairs": pairs},
        }

    status, reason = _decide(metrics(0.125, 4), heads, None, None, config)
    assert status == registry.PROMOTED and "not judged" in reason and "selection on 4" in reason, reason
    status, reason = _decide(metrics(0.40, 40), heads, None, None, config)
    assert status == registry.CANDIDATE and "selection: 0.400 does not beat the trivial baseline" in reason
    # a pointwise head's evidence is its rarer class: 3 positives of 30 cannot tell, 60 of 200 can
    assert _decide(metrics(0.8, 40, auc=0.45, n=30, rate=0.1), heads, None, None, config)[0] == registry.PROMOTED
    status, reason = _decide(metrics(0.8, 40, auc=0.45, n=200, rate=0.3), heads, None, None, config)
    assert status == registry.CANDIDATE and "acceptance" in reason
    # the bundle's own checks still decide: under chance, or no better than the current version
    status, reason = _decide(metrics(0.125, 4, primary=0.49), heads, None, None, config)
    assert status == registry.CANDIDATE and "chance" in reason
    current = type("Current", (), {"version": "rm-0001"})()
    status, reason = _decide(metrics(0.125, 4, primary=0.8), heads, current, 0.9, config)
    assert status == registry.CANDIDATE and "does not beat rm-0001" in reason
    # 0: every head judged whatever its hold-out (the rule before)
    strict = RewardsConfig(head_check_min_evidence=0)
    assert _decide(metrics(0.125, 4), heads, None, None, strict)[0] == registry.CANDIDATE
    # a small hold-out of one class (the demo's second model: 12 accepts, no reject) has no AUC: left
    # unjudged like any small one; on a hold-out of nothing, or under the strict rule, it still refuses
    one_class = metrics(0.8, 40, auc=None, n=12, rate=1.0)
    status, reason = _decide(one_class, heads, None, None, config)
    assert status == registry.PROMOTED and "acceptance on 0, undefined" in reason, reason
    assert _decide(one_class, heads, None, None, strict)[0] == registry.CANDIDATE
    # nothing held out: the demo refused its first two models (bundle 0.67 and 0.76) because no selection
    # pair fell among the newest sessions; that is no evidence either way, so the bundle's checks decide
    status, reason = _decide(metrics(0.8, 40, auc=None, n=0, rate=None), heads, None, None, config)
    assert status == registry.PROMOTED and "acceptance, nothing held out" in reason, reason
    status, reason = _decide(metrics(None, 0), heads, None, None, config)
    assert status == registry.PROMOTED and "selection, nothing held out" in reason, reason
    assert _decide(metrics(None, 0, primary=0.49), heads, None, None, config)[0] == registry.CANDIDATE
    assert _decide(metrics(None, 0), heads, None, None, strict)[0] == registry.CANDIDATE
    # metrics that do not say how much was held out still refuse
    silent = metrics(None, 0)
    del silent["selection"]["pairs"]
    status, reason = _decide(silent, heads, None, None, config)
    assert status == registry.CANDIDATE and "selection: hold-out metric undefined" in reason


def test_a_hold_out_too_small_to_tell_two_versions_apart_prefers_the_one_trained_on_more_labels() -> None:
    """An ablation seed kept its second model, trained on 125 labeled sessions, to the end: each of five
    retrains on 195 to 228 lost to it on a hold-out of a few labels and pairs (0.715 against 0.754, a
    tie at 0.619). On a hold-out under ``head_check_min_evidence`` the version trained on more labels
    replaces the current one; on a hold-out that can tell, or trained on no more, it must still beat
    it; a head's check that can tell still refuses, and so does the chance floor where the hold-out can
    tell or no version is promoted yet; the setting turns the rule off."""
    from reward_models.train import _decide

    heads = {"retention": object()}
    config = RewardsConfig()
    current = type("Current", (), {"version": "rm-0002", "n_labeled": 125})()  # a registry row's fields

    def metrics(primary: float, evidence: int | None) -> dict[str, Any]:
        bundle: dict[str, Any] = {"finite": True, "primary": primary}
        if evidence is not None:
            bundle["evidence"] = evidence
        return {"bundle": bundle, "retention": {"auc": 0.7, "auc_baseline": 0.5, "n": 20, "positive_rate": 0.8}}

    status, reason = _decide(metrics(0.715, 9), heads, current, 0.754, config, n_labeled=195)
    assert status == registry.PROMOTED and "replaces rm-0002" in reason and "195 against 125" in reason, reason
    # a tie is no longer a refusal on such a hold-out
    assert _decide(metrics(0.619, 3), heads, current, 0.619, config, n_labeled=217)[0] == (registry.PROMOTED)
    # a hold-out that can tell them apart still decides
    status, reason = _decide(metrics(0.715, 40), heads, current, 0.754, config, n_labeled=195)
    assert status == registry.CANDIDATE and "does not beat rm-0002" in reason
    # a retrain on no more labels (the same data again) does not replace it
    status, _ = _decide(metrics(0.715, 9), heads, current, 0.754, config, n_labeled=125)
    assert status == registry.CANDIDATE
    # metrics of before the bundle's evidence was recorded, or no counts: the old rule
    assert _decide(metrics(0.715, None), heads, current, 0.754, config, n_labeled=195)[0] == (registry.CANDIDATE)
    assert _decide(metrics(0.715, 9), heads, current, 0.754, config)[0] == registry.CANDIDATE
    # the chance floor, too, refuses a replacement only on a hold-out that can tell: an ablation seed kept
    # its first model while retrains scored 0.37 against its 0.32 on 17 observations, both "under chance"
    status, reason = _decide(metrics(0.367, 17), heads, current, 0.317, config, n_labeled=189)
    assert status == registry.PROMOTED and "beats rm-0002" in reason, reason
    assert "chance floor not judged: 0.367 on 17 observations" in reason, reason
    status, reason = _decide(metrics(0.45, 9), heads, current, 0.754, config, n_labeled=195)
    assert status == registry.PROMOTED and "replaces rm-0002" in reason and "chance floor not judged" in reason
    assert _decide(metrics(0.45, 9), heads, current, 0.754, config, n_labeled=125)[0] == registry.CANDIDATE
    # on a hold-out that can tell, under chance is refused whatever it trained on; so is a first version
    # under chance on any hold-out (no model is its fallback), and any with the rule turned off
    status, reason = _decide(metrics(0.45, 40), heads, current, 0.3, config, n_labeled=195)
    assert status == registry.CANDIDATE and "does not beat chance" in reason
    status, reason = _decide(metrics(0.45, 9), heads, None, None, config, n_labeled=195)
    assert status == registry.CANDIDATE and "does not beat chance" in reason
    off = RewardsConfig(small_holdout_prefers_more_labels=False)
    status, reason = _decide(metrics(0.367, 17), heads, current, 0.317, off, n_labeled=189)
    assert status == registry.CANDIDATE and "does not beat chance" in reason
    # a head that fails on a hold-out large enough to tell still refuses
    failing = metrics(0.715, 9)
    failing["retention"] = {"auc": 0.45, "auc_baseline": 0.5, "n": 200, "positive_rate": 0.3}
    status, reason = _decide(failing, heads, current, 0.754, config, n_labeled=195)
    assert status == registry.CANDIDATE and "retention" in reason
    assert _decide(metrics(0.715, 9), heads, current, 0.754, off, n_labeled=195)[0] == (registry.CANDIDATE)


def test_the_bundle_metrics_count_the_evidence_their_primary_rests_on() -> None:
    """Labels of the rarer class (at the positive threshold) plus the hold-out's selection pairs."""
    from reward_models.train import bundle_metrics

    class Constant:
        def score(self, frame: pd.DataFrame) -> np.ndarray:
            return np.arange(len(frame), dtype=float)

    test = pd.DataFrame(
        {"session_id": list("abcdef"), "reward": [0.9, 0.8, 0.2, np.nan, 0.7, 0.6]},
    )
    pairs = pd.DataFrame({"chosen": ["a", "e"], "rejected": ["c", "f"]})
    bundle = RewardBundle(heads={"h": Constant()}, weights={"h": 1.0})
    m = bundle_metrics(bundle, test, pairs, 0.5)
    assert m["evidence"] == 1 + 2  # one label under 0.5 of five, two pairs
    assert bundle_metrics(bundle, test, pairs.iloc[:0], 0.5)["evidence"] == 1


@pytest.mark.parametrize(
    "knob",
    ["retention_require_final", "retention_head_final"],  # labels wait too / labels use what was measured so far
)
def test_a_late_label_is_held_out_on_its_own_newest_sessions_and_the_model_can_be_promoted(
    sqlite_engine: Engine, load_events: Any, tmp_path: Path, knob: str
) -> None:
    """Four days of traffic, trained an hour after the last session: retention is final (its one-day
    horizon elapsed) only for sessions older than a day, so the bundle's hold-out (the newest sessions)
    holds none. The retention head is then tested on the newest of its own labeled sessions, all newer
    than every session it trained on and none in the bundle's hold-out, and the model is promoted."""
    span = 4 * 86400
    now = START + timedelta(seconds=span + 3600)
    events, _ = generate_events(600, seed=11, start=START, span_s=span, now=now)
    load_events(sqlite_engine, [e for e in events if e["type"] not in ("edit.accepted", "edit.rejected")])
    config = RewardsConfig(**{knob: True})  # the retention head waits for the longest horizon
    report = train_reward_models(sqlite_engine, config, tmp_path, now=now)
    assert report.status == registry.PROMOTED, report.reason

    bundle_cutoff = datetime.fromisoformat(report.window["holdout_from"])
    retention_cutoff = datetime.fromisoformat(report.metrics["retention"]["holdout_from"])
    final_until = now - timedelta(seconds=max(config.retention_weights) + config.retention_grace_s)
    assert final_until < bundle_cutoff  # no session of the bundle's hold-out has a final retention label
    assert retention_cutoff < final_until  # its own hold-out: the newest sessions with one
    assert report.metrics["retention"]["auc"] > report.metrics["retention"]["auc_baseline"] + 0.1
    assert report.metrics["privileged"]["auc"] is not None


def test_the_retention_head_can_wait_for_final_retention_while_labels_do_not() -> None:
    import pandas as pd

    from reward_models.train import pointwise_rows

    frame = pd.DataFrame(
        {
            "retention": [0.9, 0.2, 0.8, 0.1, 0.95, 0.3],  # the last two: only the first hour measured
            "retention_final": [True, True, True, True, False, False],
            "acceptance": [1.0, 0.0, np.nan, 1.0, 0.0, 1.0],
        },
        index=pd.Index([f"s{i}" for i in range(6)], name="session_id"),
    )
    rows, y = pointwise_rows(frame, "retention", RewardsConfig())
    assert list(rows.index) == [f"s{i}" for i in range(6)] and list(y) == [1, 0, 1, 0, 1, 0]
    waits = RewardsConfig(retention_head_final=True)
    rows, y = pointwise_rows(frame, "retention", waits)
    assert list(rows.index) == ["s0", "s1", "s2", "s3"] and list(y) == [1, 0, 1, 0]
    rows, _ = pointwise_rows(frame, "acceptance", waits)  # other heads are not affected
    assert list(rows.index) == ["s0", "s1", "s3", "s4", "s5"]
    assert not waits.retention_require_final  # the labels RL trains on still use the first hour


def test_a_head_never_trains_on_the_bundles_hold_out() -> None:
    """:func:`head_split` on a frame of labeled rows: the head's cutoff is never later than the
    bundle's, its training rows are all older than its hold-out, and the hold-out is the newest
    fraction of the rows that carry its label."""
    import pandas as pd

    from reward_models.train import head_split

    config = RewardsConfig()
    times = pd.date_range(START, periods=100, freq="h", tz="UTC")
    frame = pd.DataFrame(
        {
            "occurred_at": times,
            "acceptance": [float(i % 2) for i in range(100)],
            "retention": [float(i % 3 == 0) if i < 60 else np.nan for i in range(100)],
            "retention_final": [i < 60 for i in range(100)],
        },
        index=pd.Index([f"s{i}" for i in range(100)], name="session_id"),
    )
    cutoff = times[80].to_pydatetime()
    (tr, _), (te, y_te), head_cutoff = head_split(frame, "retention", cutoff, config)
    assert head_cutoff == times[48].to_pydatetime()  # the newest 20% of its 60 labeled rows
    assert len(tr) == 48 and len(te) == 12 and set(y_te) == {0, 1}
    assert tr["occurred_at"].max() < te["occurred_at"].min()
    (tr, _), (te, _), head_cutoff = head_split(frame, "acceptance", cutoff, config)
    assert head_cutoff == cutoff and len(tr) == 80 and len(te) == 20  # covered everywhere: the bundle's split


@pytest.mark.parametrize("prefers_more_labels", [True, False])
def test_the_registry_serves_the_model_the_small_hold_out_rule_promotes(
    engine: Engine,
    synthetic_600: Any,
    load_events: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prefers_more_labels: bool,
) -> None:
    """End to end through the registry: a first model trained on the older half is promoted and scores.
    A retrain on every session then meets the ablation seed's case: a hold-out of 17 observations on
    which the candidate scores 0.367 and the promoted model 0.317, both under chance. The candidate,
    trained on more labeled sessions, is what the registry serves afterwards; with the rule turned off
    the chance floor refuses it and the first model keeps scoring."""
    import reward_models.train as train_mod

    config = RewardsConfig(small_holdout_prefers_more_labels=prefers_more_labels)
    events, _ = synthetic_600
    load_events(engine, events)
    first = train_reward_models(engine, config, tmp_path, now=NOW, until=START + timedelta(days=3))
    assert first.status == registry.PROMOTED, first.reason
    assert load_scorer(engine).version == first.version

    real = train_mod.bundle_metrics
    calls: list[float] = []

    def small_holdout(bundle: RewardBundle, test: pd.DataFrame, pairs: pd.DataFrame, threshold: float) -> Any:
        out = real(bundle, test, pairs, threshold)  # the candidate is scored first, the promoted model second
        out.update(primary=0.367 if not calls else 0.317, evidence=17)
        calls.append(out["primary"])
        return out

    monkeypatch.setattr(train_mod, "bundle_metrics", small_holdout)
    second = train_reward_models(engine, config, tmp_path, now=NOW)
    assert calls == [0.367, 0.317]
    assert (
        registry.get_version(engine, second.version).n_labeled > registry.get_version(engine, first.version).n_labeled
    )
    served = load_scorer(engine).version
    if prefers_more_labels:
        assert second.status == registry.PROMOTED and "chance floor not judged" in second.reason, second.reason
        assert served == second.version and registry.current_promoted(engine).version == second.version
    else:
        assert second.status == registry.CANDIDATE and "does not beat chance" in second.reason, second.reason
        assert served == first.version and registry.current_promoted(engine).version == first.version
