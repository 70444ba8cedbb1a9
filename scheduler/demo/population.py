"""Simulated users that behave like real ones: differing tastes, noisy judgement, sparse and late
feedback, frustration, churn and a few adversaries. Seeded and deterministic for a seed and a call
sequence; pure Python and numpy, no transport.

:meth:`Population.react` turns what the assistant produced for one session (an :class:`Outcome`
per candidate or per parallel agent session, as the task family's checker judged it) into the
telemetry the user's reaction produces: :class:`Signal` objects carrying the wire event type, the
wire payload (less the ids the caller owns) and the simulated delay at which each one *arrives*.
The caller sends them and schedules the delays. The user's *true* utility of each outcome comes
back beside them for evaluation only; it never enters a payload.

Model (every number a :class:`PopulationConfig` knob; defaults in brackets):

- **Users** differ: ``taste`` (how much verbose code costs them) ~ Beta(2, 2), ``skill`` (how
  well they judge code) ~ Beta(4, 2), ``patience`` ~ Beta(3, 2), ``signal_propensity`` ~
  Beta(3, 2), arrival weight ``activity`` ~ LogNormal(0, 1) (heavy-tailed: a few users make most
  requests). ``round(bad_actor_share * users)`` of them [4%] are bad actors.
- **True utility** depends on the outcome's class and the user only: kept 1.0; passing but
  verbose ``1 - verbosity_cost * taste`` [0.7]; failing ``salvage_max * skill`` [0.15] (a skilled
  user salvages some); never submitted 0.
- **Perception**: the user judges an outcome by its true utility plus Gaussian noise whose std
  falls linearly with skill from ``noise_max`` [0.5] to ``noise_min`` [0.02]; a session that
  submitted nothing is seen for what it is (0, no noise).
- **Selection** (``grouped``, K >= 2): ``candidates.shown`` always arrives (client telemetry,
  uniform 0..``shown_delay_max_s`` [2 s]); the user picks the best perceived candidate (ties at
  random); ``candidate.selected`` is reported with probability ``select_rate`` [0.6] x propensity,
  after an exponential delay [mean 20 s].
- **Acceptance**: the user accepts when perceived utility >= ``accept_threshold`` [0.5], so a
  noisy judge sometimes accepts failing code and rejects good code; ``edit.accepted`` /
  ``edit.rejected`` (``{lines}``) is reported with probability ``accept_rate`` [0.5] x propensity,
  an exponential delay [mean 60 s] after the selection. In a group only the selected candidate is
  judged; ungrouped outcomes (parallel agent sessions) are each judged on their own.
- **Thumbs** are rare and biased towards bad experiences: probability ``thumbs_rate_bad`` [0.16]
  x propensity when the perceived utility is below the threshold (value -1), ``thumbs_rate_good``
  [0.04] x propensity otherwise (value +1): 3-4% of sessions, most of them thumbs down.
- **Retention**: ``code.retained`` for a share ``retention_rate`` [0.4] x propensity of the judged
  submitted outcomes (the editor plugin is on for them; the same outcomes at every horizon), at
  each of ``horizons_s`` [1 h, 1 day, 1 week], arriving ``horizon + Exp(mean retention_lateness x
  horizon)`` [0.1] later (reports are batched). ``lines_retained`` is binomial over
  ``lines_written = outcome.lines`` with share ``retain_kept`` [0.9] for kept code, ``retain_kept
  x (1 - verbose_rewrite x taste)`` (``verbose_rewrite`` [0.6]) for verbose code and ``retain_failed`` [0.15] for
  failing code, times ``retain_decay`` [0.9] per later horizon, thinned horizon to horizon so it
  never grows. With ``first_horizon_rewrite`` [1] below 1, only that share of the gap between kept
  code's share and the class's is gone at the first horizon (rewrites take time); the second horizon
  shows the whole of it. It follows the true outcome, not the accept decision. A session that never
  submitted has nothing in the editor: no retention event at all.
- **Frustration**: a session is useless when its best true utility is below ``useful_utility``
  [0.5]. Then the user switches models (``model.switched``) with probability ``switch_rate`` [0.3]
  x (1 - patience) x (1 - best utility), after an exponential delay [mean 300 s]. Each user keeps
  a frustration level, an exponential average of useless sessions (``frustration_decay`` [0.8]);
  after a useless session the churn hazard is ``churn_rate`` [0.1] x max(0, frustration -
  patience) / (1 - patience), so only repeated bad sessions make anyone leave. A churned user
  emits ``user.churned`` (``{inactive_days}`` [14], user level, arriving after those days plus an
  exponential lateness [mean 1 h]) once and is never drawn again.
- **Bad actors** send adversarial explicit signals: they select the worst perceived candidate,
  accept what they perceive as bad and reject what they perceive as good, invert their thumbs,
  and report each explicit signal ``bad_actor_boost`` [2x] as often. Their true utility, their
  retention (measured by the plugin, not reported by them) and ``candidates.shown`` are honest;
  they never switch models or churn (they stay to keep poisoning).

Left out: duplicated or reordered deliveries (the transport's business), edits of the code
itself (``final_text``), and any dependence of utility on how verbose a verbose body is (utility
depends on the class only, so :meth:`Population.expected_utility` can score held-out rates).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

SECONDS_PER_DAY = 86400

_UNIT_KNOBS = (
    "bad_actor_share",
    "verbosity_cost",
    "salvage_max",
    "accept_threshold",
    "useful_utility",
    "select_rate",
    "accept_rate",
    "thumbs_rate_good",
    "thumbs_rate_bad",
    "retention_rate",
    "retain_kept",
    "verbose_rewrite",
    "retain_failed",
    "retain_decay",
    "first_horizon_rewrite",
    "switch_rate",
    "churn_rate",
)
"""Knobs that are probabilities, shares or utilities (0..1)."""
_NON_NEGATIVE_KNOBS = (
    "activity_sigma",
    "noise_max",
    "noise_min",
    "shown_delay_max_s",
    "select_delay_mean_s",
    "accept_delay_mean_s",
    "thumbs_delay_mean_s",
    "switch_delay_mean_s",
    "retention_lateness",
    "churn_lateness_mean_s",
)
"""Knobs that are spreads, delays or latenesses (>= 0)."""


@dataclass(frozen=True)
class Outcome:
    """What the assistant produced for one session, as the task family's checker judged it."""

    passed: bool
    """Passes the hidden tests."""
    kept: bool
    """Passes and is concise (the family's keep rule)."""
    lines: int
    """Non-empty lines written (>= 1 when submitted)."""
    size: int = 0
    """Body size the checker measured."""
    size_limit: int = 0
    """The task's concise size (0: unknown)."""
    submitted: bool = True
    """False: an agent session that never submitted (nothing to keep)."""

    def __post_init__(self) -> None:
        if self.kept and not self.passed:
            raise ValueError("Outcome: kept code must also pass (kept=True needs passed=True)")
        if self.passed and not self.submitted:
            raise ValueError("Outcome: a session that never submitted cannot pass (passed=True needs submitted=True)")
        if self.lines < 0 or (self.submitted and self.lines < 1):
            raise ValueError(f"Outcome: lines must be >= 1 when submitted and >= 0 otherwise, got {self.lines}")


@dataclass(frozen=True)
class User:
    """One simulated user; the traits are hidden from the system under test."""

    user_id: str
    """``dev-007`` style."""
    taste: float
    """0..1: how much verbosity (passing but not concise code) costs this user."""
    skill: float
    """0..1: how well they judge code (noise of their choices and accept decisions) and salvage failing code."""
    patience: float
    """0..1: tolerance of bad answers before switching model or churning."""
    activity: float
    """Relative arrival weight (lognormal)."""
    signal_propensity: float
    """0..1 multiplier of this user's signal rates."""
    bad_actor: bool
    """Sends adversarial explicit signals."""


@dataclass(frozen=True)
class Signal:
    """One event a reaction produces (the caller adds the envelope and the ids it owns)."""

    delay_s: float
    """Simulated seconds after the session ended when it arrives (reporting lateness included)."""
    type: str
    """A wire event type."""
    index: int | None
    """Which outcome of the group it is about (None: user level). ``candidates.shown`` is about the
    group; its index is 0, the first candidate in display order, whose session carries it."""
    payload: dict[str, Any]
    """The wire payload, less ``group_id``/``session_ids``/``chosen_session_id`` (the caller's ids)."""


@dataclass(frozen=True)
class Reaction:
    """A user's reaction to one session."""

    signals: tuple[Signal, ...]
    """In order of arrival."""
    chosen: int | None
    """The outcome the user took into their code: in a group the selected candidate if they accepted
    it; otherwise the best (by their perception) of the outcomes they accepted. None: took none."""
    utility: tuple[float, ...]
    """True utility in [0, 1] of each outcome for this user: for evaluation only, never in a payload."""
    churned: bool
    """This reaction made the user churn (``user.churned`` is among the signals)."""
    selected: int | None = None
    """The candidate the user picked in a group, reported or not (None: ungrouped, or nothing submitted)."""


@dataclass(frozen=True)
class PopulationConfig:
    """How the simulated users behave (the module docstring explains the model)."""

    users: int = 48
    """Number of users."""
    taste_beta: tuple[float, float] = (2.0, 2.0)
    """Beta(a, b) of taste."""
    skill_beta: tuple[float, float] = (4.0, 2.0)
    """Beta(a, b) of skill."""
    patience_beta: tuple[float, float] = (3.0, 2.0)
    """Beta(a, b) of patience."""
    propensity_beta: tuple[float, float] = (3.0, 2.0)
    """Beta(a, b) of the signal propensity."""
    activity_sigma: float = 1.0
    """Sigma of the lognormal activity weights (0: every user equally active)."""
    bad_actor_share: float = 0.04
    """Share of bad actors (rounded to a count)."""
    verbosity_cost: float = 0.7
    """Utility lost on passing but verbose code by a user of taste 1."""
    salvage_max: float = 0.15
    """Utility of failing code to a user of skill 1 (at most 1 - verbosity_cost)."""
    noise_max: float = 0.5
    """Perception noise std at skill 0."""
    noise_min: float = 0.02
    """Perception noise std at skill 1."""
    accept_threshold: float = 0.5
    """Perceived utility from which a user accepts an edit (and rates it good)."""
    useful_utility: float = 0.5
    """True utility below which a session was useless to the user (frustration)."""
    select_rate: float = 0.6
    """Probability that a selection is reported, times the propensity."""
    accept_rate: float = 0.5
    """Probability that an accept or reject is reported, times the propensity."""
    thumbs_rate_good: float = 0.04
    """Probability of a thumb on a perceived-good outcome, times the propensity."""
    thumbs_rate_bad: float = 0.16
    """Probability of a thumb on a perceived-bad outcome, times the propensity."""
    retention_rate: float = 0.4
    """Share of submitted outcomes whose retention is measured, times the propensity."""
    bad_actor_boost: float = 2.0
    """Bad actors report explicit signals this many times as often (capped at probability 1)."""
    retain_kept: float = 0.9
    """Share of kept code still there at the first horizon."""
    verbose_rewrite: float = 0.6
    """Share of retained verbose code a user of taste 1 rewrites away."""
    retain_failed: float = 0.15
    """Share of failing code still there at the first horizon."""
    retain_decay: float = 0.9
    """Factor on the retained share per later horizon."""
    first_horizon_rewrite: float = 1.0
    """Share of what a user eventually rewrites or removes (verbose code's rewrite, failing code's removal)
    that is already gone at the first horizon; the rest goes by the second. 1: the first horizon tells
    all a later one does; less: early, everything looks nearly kept, and only later horizons tell."""
    switch_rate: float = 0.3
    """Probability of a model switch after a useless session by a user of patience 0."""
    switch_targets: tuple[str, ...] = ("other-large", "other-fast")
    """Models a user switches to."""
    model_name: str = "undertow"
    """The model a user switches away from."""
    frustration_decay: float = 0.8
    """Weight of the past in the frustration average (0..1, exclusive of 1)."""
    churn_rate: float = 0.1
    """Churn hazard after a useless session at full frustration."""
    churn_inactive_days: int = 14
    """Days of inactivity after which a churned user is reported."""
    shown_delay_max_s: float = 2.0
    """``candidates.shown`` arrives uniformly within this many seconds."""
    select_delay_mean_s: float = 20.0
    """Mean (exponential) time to a selection."""
    accept_delay_mean_s: float = 60.0
    """Mean (exponential) time from selection to an accept or reject."""
    thumbs_delay_mean_s: float = 120.0
    """Mean (exponential) time from the accept decision to a thumb."""
    switch_delay_mean_s: float = 300.0
    """Mean (exponential) time to a model switch."""
    retention_lateness: float = 0.1
    """Mean lateness of a retention report as a fraction of its horizon (exponential)."""
    churn_lateness_mean_s: float = 3600.0
    """Mean (exponential) lateness of a churn report after the inactive days."""
    horizons_s: tuple[int, ...] = (3600, 86400, 604800)
    """Retention horizons in simulated seconds (increasing)."""

    def __post_init__(self) -> None:
        for name in _UNIT_KNOBS:
            _check(0.0 <= getattr(self, name) <= 1.0, name, "must be in [0, 1]")
        for name in _NON_NEGATIVE_KNOBS:
            _check(getattr(self, name) >= 0.0, name, "must be >= 0")
        for name in ("taste_beta", "skill_beta", "patience_beta", "propensity_beta"):
            pair = getattr(self, name)
            _check(len(pair) == 2 and all(p > 0 for p in pair), name, "must be two Beta parameters > 0")
        _check(self.users >= 1, "users", "must be >= 1")
        _check(self.salvage_max <= 1.0 - self.verbosity_cost, "salvage_max", "must be <= 1 - verbosity_cost")
        _check(self.noise_min <= self.noise_max, "noise_min", "must be <= noise_max")
        _check(self.bad_actor_boost >= 1.0, "bad_actor_boost", "must be >= 1")
        _check(0.0 <= self.frustration_decay < 1.0, "frustration_decay", "must be in [0, 1)")
        _check(self.churn_inactive_days >= 1, "churn_inactive_days", "must be >= 1")
        _check(len(self.switch_targets) > 0, "switch_targets", "must name at least one model")
        hs = self.horizons_s
        _check(all(h > 0 for h in hs) and list(hs) == sorted(set(hs)), "horizons_s", "must be increasing and > 0")


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"PopulationConfig.{name} {rule}")


def draw_users(config: PopulationConfig, gen: np.random.Generator) -> list[User]:
    """The population's users, traits drawn from the configured distributions."""
    n = config.users
    taste = gen.beta(*config.taste_beta, n)
    skill = gen.beta(*config.skill_beta, n)
    patience = gen.beta(*config.patience_beta, n)
    propensity = gen.beta(*config.propensity_beta, n)
    activity = gen.lognormal(0.0, config.activity_sigma, n)
    bad = set(gen.choice(n, size=round(config.bad_actor_share * n), replace=False).tolist())
    return [
        User(
            user_id=f"dev-{i:03d}",
            taste=float(taste[i]),
            skill=float(skill[i]),
            patience=float(patience[i]),
            activity=float(activity[i]),
            signal_propensity=float(propensity[i]),
            bad_actor=i in bad,
        )
        for i in range(n)
    ]


def _exp(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def _binomial(rng: random.Random, n: int, p: float) -> int:
    return sum(rng.random() < p for _ in range(n))


class Population:
    """The users, their hidden state (frustration, churn) and their reactions."""

    def __init__(self, config: PopulationConfig | None = None, seed: int = 0) -> None:
        self.config = config or PopulationConfig()
        self.rng = random.Random(seed)
        self.users: list[User] = draw_users(self.config, np.random.default_rng(seed))
        self._frustration = {u.user_id: 0.0 for u in self.users}
        self._churned: set[str] = set()
        self._lock = threading.Lock()

    def draw(self, rng: random.Random | None = None) -> User:
        """An active (not churned) user, weighted by activity."""
        active = [u for u in self.users if u.user_id not in self._churned]
        if not active:
            raise RuntimeError("every user of the population has churned; nobody is left to draw")
        return (rng or self.rng).choices(active, weights=[u.activity for u in active])[0]

    def churned(self) -> set[str]:
        """Ids of the users who churned."""
        return set(self._churned)

    def frustration(self, user: User) -> float:
        """The user's current frustration level (0..1)."""
        return self._frustration.get(user.user_id, 0.0)

    def utility(self, user: User, outcome: Outcome) -> float:
        """True utility in [0, 1] of ``outcome`` for ``user`` (its class and the user only)."""
        if not outcome.submitted:
            return 0.0
        if outcome.kept:
            return 1.0
        if outcome.passed:
            return 1.0 - self.config.verbosity_cost * user.taste
        return self.config.salvage_max * user.skill

    def expected_utility(self, keep_rate: float, pass_rate: float, submit_rate: float = 1.0) -> float:
        """Activity-weighted mean true utility over the whole population (churned users included, so
        versions evaluated at different times are scored alike) of a version whose outcomes are kept
        at ``keep_rate``, pass at ``pass_rate`` and are submitted at ``submit_rate`` (by default every
        failure counts as submitted failing code)."""
        if not 0.0 <= keep_rate <= pass_rate <= submit_rate <= 1.0:
            raise ValueError(
                f"expected_utility needs 0 <= keep_rate <= pass_rate <= submit_rate <= 1, "
                f"got {keep_rate}, {pass_rate}, {submit_rate}"
            )
        weights = np.array([u.activity for u in self.users])
        taste = float(np.average([u.taste for u in self.users], weights=weights))
        skill = float(np.average([u.skill for u in self.users], weights=weights))
        verbose = 1.0 - self.config.verbosity_cost * taste
        salvage = self.config.salvage_max * skill
        return keep_rate + (pass_rate - keep_rate) * verbose + (submit_rate - pass_rate) * salvage

    def noise_std(self, user: User) -> float:
        """Std of the user's perception noise (falls linearly with skill)."""
        cfg = self.config
        return cfg.noise_min + (cfg.noise_max - cfg.noise_min) * (1.0 - user.skill)

    def report_probability(self, user: User, rate: float, explicit: bool = True) -> float:
        """Probability that ``user`` reports a signal of base ``rate`` (propensity, bad actors' boost)."""
        boost = self.config.bad_actor_boost if explicit and user.bad_actor else 1.0
        return min(1.0, rate * user.signal_propensity * boost)

    def retention_share(self, user: User, outcome: Outcome, step: int) -> float:
        """Expected share of ``outcome``'s lines still there at horizon number ``step`` (0: the first)."""
        cfg = self.config
        if not outcome.submitted:
            return 0.0
        if outcome.kept:
            share = cfg.retain_kept
        elif outcome.passed:
            share = cfg.retain_kept * (1.0 - cfg.verbose_rewrite * user.taste)
        else:
            share = cfg.retain_failed
        if step == 0 and cfg.first_horizon_rewrite < 1.0:  # part of the rewrite done: between kept's and the class's
            return cfg.retain_kept + cfg.first_horizon_rewrite * (share - cfg.retain_kept)
        return share * cfg.retain_decay**step

    def react(
        self, user: User, outcomes: Sequence[Outcome], *, grouped: bool, rng: random.Random | None = None
    ) -> Reaction:
        """The user's reaction to one session's ``outcomes``: a candidate group shown side by side
        (``grouped``, K >= 2) or outcomes judged each on their own (one completion, parallel agent
        sessions). Updates the user's frustration and may churn them."""
        if not outcomes:
            raise ValueError("react needs at least one outcome")
        if grouped and len(outcomes) < 2:
            raise ValueError(f"a grouped reaction needs K >= 2 outcomes, got {len(outcomes)}")
        with self._lock:
            r = rng or self.rng
            utility = tuple(self.utility(user, o) for o in outcomes)
            std = self.noise_std(user)
            perceived = [u + r.gauss(0.0, std) if o.submitted else 0.0 for u, o in zip(utility, outcomes, strict=True)]
            sign = -1.0 if user.bad_actor else 1.0
            submitted = [i for i, o in enumerate(outcomes) if o.submitted]
            signals: list[Signal] = []
            selected: int | None = None
            chosen: int | None = None
            if grouped:
                signals.append(Signal(r.uniform(0.0, self.config.shown_delay_max_s), "candidates.shown", 0, {}))
                if submitted:
                    selected = min(submitted, key=lambda i: (-sign * perceived[i], r.random()))
                    at = _exp(r, self.config.select_delay_mean_s)
                    if r.random() < self.report_probability(user, self.config.select_rate):
                        signals.append(Signal(at, "candidate.selected", selected, {}))
                    if self._judge(user, selected, outcomes[selected], perceived[selected], at, r, signals):
                        chosen = selected
                    self._retain(user, selected, outcomes[selected], r, signals)
            else:
                accepted = []
                for i, outcome in enumerate(outcomes):
                    if self._judge(user, i, outcome, perceived[i], 0.0, r, signals) and outcome.submitted:
                        accepted.append(i)
                    self._retain(user, i, outcome, r, signals)
                if accepted:
                    chosen = max(accepted, key=lambda i: sign * perceived[i])
            about = chosen if chosen is not None else (selected if selected is not None else 0)
            churned = self._frustrate(user, max(utility), about, r, signals)
            signals.sort(key=lambda s: s.delay_s)
            return Reaction(tuple(signals), chosen, utility, churned, selected)

    def _judge(
        self, user: User, index: int, outcome: Outcome, perceived: float, at: float, r: random.Random, out: list[Signal]
    ) -> bool:
        """Accept or reject one outcome (reported or not) and maybe thumb it; returns the decision."""
        cfg = self.config
        good = perceived >= cfg.accept_threshold
        accepted = good != user.bad_actor
        at += _exp(r, cfg.accept_delay_mean_s)
        if r.random() < self.report_probability(user, cfg.accept_rate):
            kind = "edit.accepted" if accepted else "edit.rejected"
            out.append(Signal(at, kind, index, {"lines": outcome.lines}))
        thumb_rate = cfg.thumbs_rate_good if good else cfg.thumbs_rate_bad
        if r.random() < self.report_probability(user, thumb_rate):
            value = (1 if good else -1) * (-1 if user.bad_actor else 1)
            out.append(Signal(at + _exp(r, cfg.thumbs_delay_mean_s), "feedback.thumbs", index, {"value": value}))
        return accepted

    def _retain(self, user: User, index: int, outcome: Outcome, r: random.Random, out: list[Signal]) -> None:
        """``code.retained`` at every horizon when the editor plugin measures this outcome."""
        cfg = self.config
        if not outcome.submitted or r.random() >= self.report_probability(user, cfg.retention_rate, explicit=False):
            return
        left, previous = outcome.lines, 1.0
        for step, horizon in enumerate(cfg.horizons_s):
            share = self.retention_share(user, outcome, step)
            left = _binomial(r, left, share / previous if previous > 0 else 0.0)
            previous = share
            payload = {"horizon_s": horizon, "lines_written": outcome.lines, "lines_retained": left}
            out.append(Signal(horizon + _exp(r, cfg.retention_lateness * horizon), "code.retained", index, payload))

    def _frustrate(self, user: User, best: float, index: int, r: random.Random, out: list[Signal]) -> bool:
        """Model switch and churn after a useless session; returns whether the user churned now."""
        cfg = self.config
        if user.bad_actor:
            return False
        useless = best < cfg.useful_utility
        level = (
            cfg.frustration_decay * self._frustration.get(user.user_id, 0.0) + (1.0 - cfg.frustration_decay) * useless
        )
        self._frustration[user.user_id] = level
        if not useless:
            return False
        if r.random() < cfg.switch_rate * (1.0 - user.patience) * (1.0 - best):
            payload = {"from_model": cfg.model_name, "to_model": r.choice(cfg.switch_targets)}
            out.append(Signal(_exp(r, cfg.switch_delay_mean_s), "model.switched", index, payload))
        if user.user_id in self._churned:
            return False
        hazard = cfg.churn_rate * max(0.0, level - user.patience) / max(1.0 - user.patience, 1e-9)
        if r.random() >= hazard:
            return False
        self._churned.add(user.user_id)
        days = cfg.churn_inactive_days
        delay = days * SECONDS_PER_DAY + _exp(r, cfg.churn_lateness_mean_s)
        out.append(Signal(delay, "user.churned", None, {"inactive_days": days}))
        log.debug("user churned", user=user.user_id, frustration=round(level, 3))
        return True
