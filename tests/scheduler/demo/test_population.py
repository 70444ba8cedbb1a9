"""The simulated user population: the statistics of its reactions over thousands of sessions
(sparse and late feedback, biased thumbs, noisy judges, adversaries, churn), its true utility and
its validation. Fixed seeds; every tolerance is several standard errors wide."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter, defaultdict
from typing import Any

import pytest

from scheduler.demo.population import Outcome, Population, PopulationConfig, Reaction, User

KEPT = Outcome(passed=True, kept=True, lines=20, size=40, size_limit=60)
VERBOSE = Outcome(passed=True, kept=False, lines=20, size=150, size_limit=60)
FAILED = Outcome(passed=False, kept=False, lines=20, size=50, size_limit=60)
NOTHING = Outcome(passed=False, kept=False, lines=0, submitted=False)
SUBMITTED = (KEPT, VERBOSE, FAILED)

PAYLOAD_KEYS = {
    "candidates.shown": set(),
    "candidate.selected": set(),
    "edit.accepted": {"lines"},
    "edit.rejected": {"lines"},
    "code.retained": {"horizon_s", "lines_written", "lines_retained"},
    "feedback.thumbs": {"value"},
    "model.switched": {"from_model", "to_model"},
    "user.churned": {"inactive_days"},
}
"""The wire payload fields each type carries (less the ids the caller fills in)."""

FEEDBACK = set(PAYLOAD_KEYS) - {"candidates.shown"}
"""Types that say something about the user's preference (``candidates.shown`` is UI telemetry)."""


def honest(**overrides: Any) -> PopulationConfig:
    """No bad actors and no churn: rate statistics over a stable population."""
    return PopulationConfig(**{"bad_actor_share": 0.0, "churn_rate": 0.0, **overrides})


def kinds(reaction: Reaction) -> list[str]:
    return [s.type for s in reaction.signals]


def true_best_selected(reaction: Reaction) -> bool:
    assert reaction.selected is not None
    return reaction.utility[reaction.selected] == max(reaction.utility)


def test_users_are_seeded_heterogeneous_and_drawn_by_activity() -> None:
    a, b, c = Population(seed=3), Population(seed=3), Population(seed=4)
    assert a.users == b.users and a.users != c.users
    assert [u.user_id for u in a.users] == [f"dev-{i:03d}" for i in range(48)]
    for trait in ("taste", "skill", "patience", "signal_propensity"):
        values = [getattr(u, trait) for u in a.users]
        assert all(0.0 < v < 1.0 for v in values) and statistics.stdev(values) > 0.1, trait
    assert sum(u.bad_actor for u in a.users) == round(0.04 * 48)
    activity = sorted(u.activity for u in a.users)
    assert activity[0] > 0 and activity[-1] > 4 * statistics.median(activity)  # heavy-tailed

    rng = random.Random(0)
    draws = Counter(a.draw(rng).user_id for _ in range(20000))
    total = sum(u.activity for u in a.users)
    worst = max(abs(draws[u.user_id] / 20000 - u.activity / total) for u in a.users)
    assert worst < 0.015


def test_true_utility_orders_the_classes_within_bounds() -> None:
    cfg = PopulationConfig()
    pop = Population(cfg, seed=1)
    for user in pop.users:
        kept, verbose, failed, nothing = (pop.utility(user, o) for o in (KEPT, VERBOSE, FAILED, NOTHING))
        assert kept == 1.0 and nothing == 0.0
        assert verbose == pytest.approx(1.0 - cfg.verbosity_cost * user.taste)
        assert 0.0 <= failed <= cfg.salvage_max and failed == pytest.approx(cfg.salvage_max * user.skill)
        assert kept >= verbose > failed >= nothing
    tasteful = max(pop.users, key=lambda u: u.taste)
    lax = min(pop.users, key=lambda u: u.taste)
    assert pop.utility(tasteful, VERBOSE) < pop.utility(lax, VERBOSE) - 0.2  # preferences differ


def test_expected_utility_matches_the_empirical_mean() -> None:
    pop = Population(PopulationConfig(activity_sigma=2.0), seed=2)  # a few heavy users dominate the mean
    rng = random.Random(2)
    keep, passed, submit = 0.1, 0.8, 0.9
    total = 0.0
    n = 30000
    for _ in range(n):
        user = pop.draw(rng)
        x = rng.random()
        outcome = KEPT if x < keep else VERBOSE if x < passed else FAILED if x < submit else NOTHING
        total += pop.utility(user, outcome)
    assert pop.expected_utility(keep, passed, submit) == pytest.approx(total / n, abs=0.008)
    assert pop.expected_utility(1.0, 1.0) == 1.0 and pop.expected_utility(0.0, 0.0, 0.0) == 0.0
    assert pop.expected_utility(0.2, 0.6) > pop.expected_utility(0.2, 0.4) > pop.expected_utility(0.1, 0.4)
    with pytest.raises(ValueError, match="keep_rate <= pass_rate"):
        pop.expected_utility(0.6, 0.4)


def test_most_sessions_send_no_feedback_and_the_share_follows_the_rates() -> None:
    pop = Population(honest(thumbs_rate_good=0.0, thumbs_rate_bad=0.0, switch_rate=0.0), seed=3)
    rng = random.Random(3)
    silent, expected, n = 0, 0.0, 4000
    for _ in range(n):
        user = pop.draw(rng)
        reaction = pop.react(user, [rng.choice(SUBMITTED)], grouped=False, rng=rng)
        silent += not reaction.signals
        p = user.signal_propensity
        expected += (1 - pop.config.accept_rate * p) * (1 - pop.config.retention_rate * p)
    assert silent / n == pytest.approx(expected / n, abs=0.03)

    pop = Population(seed=3)  # the defaults, thumbs, switches, bad actors and churn included
    silent_groups = silent_single = 0
    for i in range(n):
        user = pop.draw(rng)
        if i % 2:
            reaction = pop.react(user, [rng.choice(SUBMITTED) for _ in range(4)], grouped=True, rng=rng)
            silent_groups += not FEEDBACK & set(kinds(reaction))
        else:
            silent_single += not pop.react(user, [rng.choice(SUBMITTED)], grouped=False, rng=rng).signals
    share_groups, share_single = silent_groups / (n / 2), silent_single / (n / 2)
    print(f"no feedback: {share_groups:.3f} of groups, {share_single:.3f} of single completions")
    assert 0.2 < share_groups < 0.6 and 0.3 < share_single < 0.7


def test_groups_are_always_shown_and_selections_reported_at_the_configured_rate() -> None:
    for rate in (0.6, 0.25):
        pop = Population(honest(select_rate=rate), seed=4)
        rng = random.Random(4)
        reported, expected, n = 0, 0.0, 4000
        for _ in range(n):
            user = pop.draw(rng)
            reaction = pop.react(user, [rng.choice(SUBMITTED) for _ in range(4)], grouped=True, rng=rng)
            shown = [s for s in reaction.signals if s.type == "candidates.shown"]
            assert len(shown) == 1 and shown[0].index == 0 and 0.0 <= shown[0].delay_s <= 2.0
            selected = [s for s in reaction.signals if s.type == "candidate.selected"]
            assert len(selected) <= 1 and all(s.index == reaction.selected for s in selected)
            reported += len(selected)
            expected += rate * user.signal_propensity
        assert reported / n == pytest.approx(expected / n, abs=0.025)
        assert reported < 0.8 * n  # many groups have no selection at all


def test_retention_arrives_after_its_horizon_with_the_configured_lateness() -> None:
    cfg = honest(horizons_s=(300, 3600, 86400), retention_lateness=0.25)
    pop = Population(cfg, seed=5)
    rng = random.Random(5)
    lateness: list[float] = []
    shares: dict[tuple[str, int], list[float]] = defaultdict(list)
    measured = expected = 0.0
    for i in range(4000):
        user = pop.draw(rng)
        name, outcome = [("kept", KEPT), ("verbose", VERBOSE), ("failed", FAILED), ("nothing", NOTHING)][i % 4]
        reaction = pop.react(user, [outcome], grouped=False, rng=rng)
        retained = sorted((s for s in reaction.signals if s.type == "code.retained"), key=lambda s: s.delay_s)
        if not outcome.submitted:
            assert not retained  # nothing in the editor, nothing measured
            continue
        assert [s.payload["horizon_s"] for s in retained] in ([], list(cfg.horizons_s))  # same session, every horizon
        measured += bool(retained)
        expected += cfg.retention_rate * user.signal_propensity
        left = [s.payload["lines_retained"] for s in retained]
        assert left == sorted(left, reverse=True)  # deleted code does not come back
        for step, s in enumerate(retained):
            horizon = s.payload["horizon_s"]
            assert s.delay_s >= horizon and s.payload["lines_written"] == outcome.lines
            lateness.append((s.delay_s - horizon) / horizon)
            shares[name, step].append(s.payload["lines_retained"] / outcome.lines)
    assert measured / 3000 == pytest.approx(expected / 3000, abs=0.03)
    assert statistics.fmean(lateness) == pytest.approx(0.25, rel=0.1)
    mean = {key: statistics.fmean(v) for key, v in shares.items()}
    assert mean["kept", 0] == pytest.approx(cfg.retain_kept, abs=0.03)
    assert mean["failed", 0] == pytest.approx(cfg.retain_failed, abs=0.03)
    assert mean["kept", 0] > mean["verbose", 0] > mean["failed", 0]
    assert mean["kept", 2] == pytest.approx(cfg.retain_kept * cfg.retain_decay**2, abs=0.03)


def test_a_slow_rewrite_shows_at_the_second_horizon_not_the_first() -> None:
    cfg = honest(horizons_s=(3600, 86400, 604800), first_horizon_rewrite=0.2, retention_rate=1.0)
    pop = Population(cfg, seed=9)
    rng = random.Random(9)
    shares: dict[tuple[str, int], list[float]] = defaultdict(list)
    for i in range(3000):
        user = pop.draw(rng)
        name, outcome = [("kept", KEPT), ("verbose", VERBOSE), ("failed", FAILED)][i % 3]
        retained = sorted(
            (s for s in pop.react(user, [outcome], grouped=False, rng=rng).signals if s.type == "code.retained"),
            key=lambda s: s.delay_s,
        )
        left = [s.payload["lines_retained"] for s in retained]
        assert left == sorted(left, reverse=True)  # still never grows
        for step, s in enumerate(retained):
            shares[name, step].append(s.payload["lines_retained"] / outcome.lines)
    mean = {key: statistics.fmean(v) for key, v in shares.items()}
    # at the first horizon only a fifth of the gap to kept code is gone: failing code looks nearly kept
    assert mean["failed", 0] == pytest.approx(cfg.retain_kept - 0.2 * (cfg.retain_kept - cfg.retain_failed), abs=0.03)
    assert mean["kept", 0] - mean["failed", 0] < 0.2 * (cfg.retain_kept - cfg.retain_failed) + 0.03
    # a day on, the whole of it: the classes stand as far apart as with an immediate rewrite
    assert mean["kept", 1] == pytest.approx(cfg.retain_kept * cfg.retain_decay, abs=0.03)
    assert mean["failed", 1] == pytest.approx(cfg.retain_failed * cfg.retain_decay, abs=0.03)
    assert mean["kept", 1] > mean["verbose", 1] > mean["failed", 1]
    assert mean["kept", 0] - mean["verbose", 0] < mean["kept", 1] - mean["verbose", 1]


def test_thumbs_are_rare_and_mostly_about_bad_experiences() -> None:
    pop = Population(honest(), seed=6)
    rng = random.Random(6)
    thumbs: dict[str, list[int]] = {"kept": [], "failed": []}
    judged = Counter[str]()
    for i in range(8000):
        name, outcome = ("kept", KEPT) if i % 2 else ("failed", FAILED)
        judged[name] += 1
        reaction = pop.react(pop.draw(rng), [outcome], grouped=False, rng=rng)
        thumbs[name] += [s.payload["value"] for s in reaction.signals if s.type == "feedback.thumbs"]
    rate = {name: len(v) / judged[name] for name, v in thumbs.items()}
    overall = (len(thumbs["kept"]) + len(thumbs["failed"])) / 8000
    print(f"thumbs: {overall:.3f} overall, {rate['failed']:.3f} on failing code, {rate['kept']:.3f} on kept code")
    assert 0.02 < overall < 0.08
    assert rate["failed"] > 2.5 * rate["kept"]
    assert thumbs["failed"].count(-1) > 0.8 * len(thumbs["failed"])
    assert thumbs["kept"].count(1) > 0.8 * len(thumbs["kept"])


def test_noisy_judges_accept_failing_code_and_reject_good_code() -> None:
    pop = Population(honest(users=200), seed=13)
    rng = random.Random(13)
    ranked = sorted(pop.users, key=lambda u: u.skill)
    wrong: dict[str, list[float]] = {}
    reported = expected = 0.0
    for half, users in (("low", ranked[:100]), ("high", ranked[100:])):
        accepted_failing: list[bool] = []
        rejected_kept: list[bool] = []
        for user in users:
            for _ in range(20):
                for outcome, decisions in ((FAILED, accepted_failing), (KEPT, rejected_kept)):
                    reaction = pop.react(user, [outcome], grouped=False, rng=rng)
                    took = reaction.chosen == 0
                    decisions.append(took if outcome is FAILED else not took)
                    edits = [s.type for s in reaction.signals if s.type.startswith("edit.")]
                    assert edits in ([], ["edit.accepted" if took else "edit.rejected"])  # reports tell the decision
                    reported += len(edits)
                    expected += pop.config.accept_rate * user.signal_propensity
        wrong[half] = [statistics.fmean(accepted_failing), statistics.fmean(rejected_kept)]
    print(f"accepted failing code, rejected kept code: {wrong}")
    assert wrong["low"][0] > 0.01 and wrong["low"][1] > 0.01
    assert wrong["low"][0] > 3 * wrong["high"][0] and wrong["low"][1] > 3 * wrong["high"][1]
    assert reported / 8000 == pytest.approx(expected / 8000, abs=0.025)


def _agreement_by_skill(pop: Population, rng: random.Random, groups: int) -> tuple[float, float]:
    """Share of groups whose selection is the true best, for the least and the most skilled third."""
    ranked = sorted(pop.users, key=lambda u: u.skill)
    third = len(ranked) // 3
    rates = []
    for users in (ranked[:third], ranked[-third:]):
        hits = [
            true_best_selected(pop.react(u, [rng.choice(SUBMITTED) for _ in range(4)], grouped=True, rng=rng))
            for u in users
            for _ in range(groups)
        ]
        rates.append(sum(hits) / len(hits))
    return rates[0], rates[1]


def test_selections_agree_with_the_true_best_more_often_the_more_skilled_the_user() -> None:
    pop = Population(honest(users=240), seed=7)
    low, high = _agreement_by_skill(pop, random.Random(7), groups=30)
    assert high > low + 0.05
    assert pop.noise_std(max(pop.users, key=lambda u: u.skill)) < pop.noise_std(min(pop.users, key=lambda u: u.skill))

    flat = Population(honest(users=240, noise_min=0.3, noise_max=0.3), seed=7)  # skill no longer sharpens judgement
    low, high = _agreement_by_skill(flat, random.Random(7), groups=30)
    assert abs(high - low) < 0.04


def test_bad_actors_send_adversarial_signals_but_have_honest_utility() -> None:
    pop = Population(PopulationConfig(users=100, bad_actor_share=0.2, churn_rate=0.0), seed=8)
    rng = random.Random(8)
    picked: dict[bool, list[float]] = {True: [], False: []}
    accepted_failing: dict[bool, list[bool]] = {True: [], False: []}
    thumbs_failing: dict[bool, list[int]] = {True: [], False: []}
    selections: dict[bool, list[float]] = {True: [], False: []}  # reported selections over their honest rate
    for user in pop.users:
        for _ in range(20):
            reaction = pop.react(user, [rng.choice(SUBMITTED) for _ in range(4)], grouped=True, rng=rng)
            assert reaction.selected is not None
            picked[user.bad_actor].append(reaction.utility[reaction.selected])
            reported = "candidate.selected" in kinds(reaction)
            selections[user.bad_actor].append(reported / (pop.config.select_rate * user.signal_propensity))
            reaction = pop.react(user, [FAILED], grouped=False, rng=rng)
            for s in reaction.signals:
                if s.type.startswith("edit."):
                    accepted_failing[user.bad_actor].append(s.type == "edit.accepted")
                if s.type == "feedback.thumbs":
                    thumbs_failing[user.bad_actor].append(s.payload["value"])
        assert pop.utility(user, KEPT) == 1.0 and pop.utility(user, NOTHING) == 0.0
    assert sum(u.bad_actor for u in pop.users) == 20
    assert statistics.fmean(picked[True]) < statistics.fmean(picked[False]) - 0.3
    assert statistics.fmean(selections[True]) > 1.5 > 1.2 > statistics.fmean(selections[False])  # louder
    assert statistics.fmean(accepted_failing[True]) > 0.8 > 0.2 > statistics.fmean(accepted_failing[False])
    assert thumbs_failing[True].count(1) > 0.8 * len(thumbs_failing[True])
    assert thumbs_failing[False].count(-1) > 0.8 * len(thumbs_failing[False])


def test_switches_follow_useless_sessions_and_fall_with_patience() -> None:
    pop = Population(honest(users=150), seed=9)
    rng = random.Random(9)
    ranked = sorted(pop.users, key=lambda u: u.patience)
    rates = []
    for users in (ranked[:50], ranked[-50:]):
        switches = []
        for user in users:
            for _ in range(30):
                reaction = pop.react(user, [FAILED, FAILED], grouped=True, rng=rng)
                switched = [s for s in reaction.signals if s.type == "model.switched"]
                switches.append(len(switched))
                for s in switched:
                    assert s.payload["from_model"] == "undertow"
                    assert s.payload["to_model"] in pop.config.switch_targets
        rates.append(statistics.fmean(switches))
    assert rates[0] > 1.5 * rates[1] > 0
    useful = [pop.react(pop.draw(rng), [KEPT, FAILED], grouped=True, rng=rng) for _ in range(2000)]
    assert not any("model.switched" in kinds(r) for r in useful)


def test_frustrated_users_churn_once_and_are_never_drawn_again() -> None:
    cfg = honest(users=12, churn_rate=1.0, patience_beta=(1.0, 4.0))
    pop = Population(cfg, seed=10)
    rng = random.Random(10)
    satisfied = pop.users[0]
    for _ in range(50):  # good sessions never frustrate
        assert not pop.react(satisfied, [KEPT, VERBOSE], grouped=True, rng=rng).churned
    assert pop.frustration(satisfied) == 0.0 and not pop.churned()

    churn_events: Counter[str] = Counter()
    sessions_before: dict[str, int] = {}
    sessions: Counter[str] = Counter()
    for _ in range(3000):
        if len(pop.churned()) == len(pop.users):
            break
        user = pop.draw(rng)
        assert user.user_id not in pop.churned()
        reaction = pop.react(user, [FAILED, NOTHING], grouped=True, rng=rng)
        sessions[user.user_id] += 1
        gone = [s for s in reaction.signals if s.type == "user.churned"]
        assert reaction.churned == bool(gone)
        for s in gone:
            assert s.index is None and s.payload["inactive_days"] == cfg.churn_inactive_days >= 1
            assert s.delay_s >= cfg.churn_inactive_days * 86400
            churn_events[user.user_id] += 1
            sessions_before[user.user_id] = sessions[user.user_id]
            assert pop.frustration(user) > user.patience  # only once bad sessions outweigh their patience
    assert pop.churned() == {u.user_id for u in pop.users} == set(churn_events)
    assert set(churn_events.values()) == {1}
    for user in pop.users:  # frustration after n bad sessions is 1 - decay**n: the patient need more of them
        needed = next(n for n in range(1, 100) if 1 - cfg.frustration_decay**n > user.patience)
        assert sessions_before[user.user_id] >= needed
    assert max(sessions_before.values()) >= 3
    with pytest.raises(RuntimeError, match="churned"):
        pop.draw(rng)
    for user in pop.users:  # sessions already in flight when they left
        late = pop.react(user, [FAILED, FAILED], grouped=True, rng=rng)
        assert not late.churned and "user.churned" not in kinds(late)
    assert pop.churned() == set(churn_events)


def test_payloads_carry_wire_fields_only_never_the_true_utility() -> None:
    pop = Population(PopulationConfig(bad_actor_share=0.1), seed=11)
    rng = random.Random(11)
    seen: Counter[str] = Counter()
    for i in range(3000):
        if len(pop.churned()) == len(pop.users):
            break
        user = pop.draw(rng)
        k = 1 + i % 4
        outcomes = [rng.choice((KEPT, VERBOSE, FAILED, FAILED, NOTHING)) for _ in range(k)]
        reaction = pop.react(user, outcomes, grouped=k >= 2 and i % 3 != 0, rng=rng)
        assert len(reaction.utility) == k and all(0.0 <= u <= 1.0 for u in reaction.utility)
        assert [s.delay_s for s in reaction.signals] == sorted(s.delay_s for s in reaction.signals)
        for s in reaction.signals:
            seen[s.type] += 1
            assert set(s.payload) == PAYLOAD_KEYS[s.type], s
            assert all(type(v) in (int, str) for v in s.payload.values()), s  # no float can leak a utility
            assert s.delay_s >= 0.0
            assert (s.index is None) == (s.type == "user.churned")
            assert s.index is None or 0 <= s.index < k
            if s.type == "feedback.thumbs":
                assert s.payload["value"] in (1, -1)
            if s.type == "code.retained":
                assert s.payload["horizon_s"] > 0 and 0 <= s.payload["lines_retained"] <= s.payload["lines_written"]
    assert set(seen) == set(PAYLOAD_KEYS)  # every type was exercised


def _run(pop: Population, rng: random.Random | None, n: int = 300) -> list[tuple[str, Reaction]]:
    out = []
    for i in range(n):
        user = pop.draw(rng)
        outcomes = [(KEPT, VERBOSE, FAILED, NOTHING)[(i * 7 + j) % 4] for j in range(1 + i % 3)]
        out.append((user.user_id, pop.react(user, outcomes, grouped=len(outcomes) > 1, rng=rng)))
    return out


def test_the_same_seed_and_calls_give_the_same_reactions() -> None:
    assert _run(Population(seed=12), None) == _run(Population(seed=12), None)
    assert _run(Population(seed=12), None) != _run(Population(seed=13), None)
    assert _run(Population(seed=12), random.Random(1)) == _run(Population(seed=12), random.Random(1))
    assert _run(Population(seed=12), random.Random(1)) != _run(Population(seed=12), random.Random(2))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"select_rate": 1.5}, r"PopulationConfig\.select_rate must be in \[0, 1\]"),
        ({"thumbs_rate_bad": -0.1}, r"PopulationConfig\.thumbs_rate_bad must be in \[0, 1\]"),
        ({"retention_rate": math.nan}, r"PopulationConfig\.retention_rate must be in \[0, 1\]"),
        ({"users": 0}, r"PopulationConfig\.users must be >= 1"),
        ({"taste_beta": (0.0, 2.0)}, r"PopulationConfig\.taste_beta must be two Beta parameters > 0"),
        ({"horizons_s": (3600, 300)}, r"PopulationConfig\.horizons_s must be increasing"),
        ({"retention_lateness": -0.5}, r"PopulationConfig\.retention_lateness must be >= 0"),
        ({"first_horizon_rewrite": 1.5}, r"PopulationConfig\.first_horizon_rewrite must be in \[0, 1\]"),
        ({"noise_min": 0.5, "noise_max": 0.1}, r"PopulationConfig\.noise_min must be <= noise_max"),
        ({"salvage_max": 0.5}, r"PopulationConfig\.salvage_max must be <= 1 - verbosity_cost"),
        ({"frustration_decay": 1.0}, r"PopulationConfig\.frustration_decay must be in \[0, 1\)"),
        ({"bad_actor_boost": 0.5}, r"PopulationConfig\.bad_actor_boost must be >= 1"),
        ({"switch_targets": ()}, r"PopulationConfig\.switch_targets must name at least one model"),
    ],
)
def test_bad_config_is_refused_with_the_knob_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PopulationConfig(**overrides)


def test_bad_outcomes_and_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="kept code must also pass"):
        Outcome(passed=False, kept=True, lines=3)
    with pytest.raises(ValueError, match="never submitted cannot pass"):
        Outcome(passed=True, kept=False, lines=3, submitted=False)
    with pytest.raises(ValueError, match="lines must be >= 1 when submitted"):
        Outcome(passed=True, kept=True, lines=0)
    pop = Population(seed=0)
    user: User = pop.users[0]
    with pytest.raises(ValueError, match="K >= 2"):
        pop.react(user, [KEPT], grouped=True)
    with pytest.raises(ValueError, match="at least one outcome"):
        pop.react(user, [], grouped=False)
