"""Reward poisoning: how far attackers move a session's label, the reward model's held-out AUC and the
canary gate's decision, with the defenses on and off, in one run.

The world (:func:`reward_models.synthetic.generate_events`, a known hidden preference): ``--users``
honest users are served ``--sessions`` sessions over ``--hours`` hours and react as users do
(retention at three horizons, accepted or rejected edits, selections, thumbs). The clean held-out
set is later in time and from other users. Attackers hold one account, or 5% of the accounts,
each with its own key bound to it. Every attacker sends, at its own capacity (``--attacker-rps``
signals a second, all through the window), signals that invert the truth about sessions it was
served: code it would keep is reported rewritten, bad code kept, edits flipped. It also floods one
honest user's session (the victim) with rejections dated now and in the year 2999.

- **defenses on**: every signal, honest ones included, goes through the real gateway's
  :meth:`serving.gateway.Gateway.signal` (trust checks, per-user signal rate, on a simulated clock:
  an attacker retries a refused signal at its next send); labels ignore signals from another user
  than the session's; training caps each user's share (``rewards.max_user_share``); the gate reads
  the gateway's robust acceptance (``serving.gateway.gate_signals_per_user``, ``gate_trim_users``).
- **defenses off**: the gateway as it was: every signal is taken and counted; no user share cap, no
  own-user rule, the gate reads the plain mean.

Reported: the victim's retention label; the held-out AUC of the trained bundle (clean training,
attacked with defenses on and off) against the held-out users' real retention; the gate decision
(:func:`serving.deploy.gate`) over ``--gate-trials`` canaries, a good canary that attackers try to
roll back and a bad one they try to push through, as the share of trials whose decision flipped.

Usage: ``python benchmarks/poisoning.py`` (``--quick`` for a smaller world). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from tqdm import tqdm  # noqa: E402

from reward_models import evaluation as ev  # noqa: E402
from reward_models.config import RewardsConfig  # noqa: E402
from reward_models.data import session_records, signal_records  # noqa: E402
from reward_models.labels import build_labels  # noqa: E402
from reward_models.synthetic import HORIZONS, generate_events  # noqa: E402
from reward_models.train import fit_reward_models  # noqa: E402
from serving.config import DeployConfig, GatewayConfig  # noqa: E402
from serving.deploy import gate  # noqa: E402
from serving.gateway import Gateway, VersionStats, static_replicas  # noqa: E402
from serving.keys import ClientKey, KeyRing  # noqa: E402

START = datetime(2026, 1, 5, tzinfo=UTC)
PLUGIN = ClientKey("editor-plugin", ("serve",))


class SimClock:
    """The gateway's rate limits read this clock: simulated seconds since the window opened."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_gateway(clock: SimClock) -> Gateway:
    """The real gateway with its default limits, its buckets on the simulated clock, no engines."""
    gw = Gateway(static_replicas([]), None, GatewayConfig(), "undertow-policy", KeyRing(None, 1e9))
    for buckets in (gw.client_rate, gw.user_rate, gw.signal_rate):
        buckets.clock = clock
    return gw


def _ts(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def world(args: argparse.Namespace) -> dict[str, Any]:
    """Honest training traffic, the clean held-out set (later, other users) and its labels."""
    span = args.hours * 3600.0
    end = START + timedelta(seconds=span)
    now = end + timedelta(seconds=span) + timedelta(days=2)
    events, _ = generate_events(args.sessions, seed=args.seed, start=START, span_s=span, now=now, users=args.users)
    held, _ = generate_events(
        args.sessions // 3, seed=args.seed + 1, start=end, span_s=span, now=now, users=max(10, args.users // 2)
    )
    for e in held:  # other users than the training ones
        if e.get("user_id"):
            e["user_id"] = "held-" + e["user_id"]
    return {"events": events, "held": held, "now": now, "span": span}


def held_out_labels(held: list[dict[str, Any]], now: datetime) -> tuple[pd.DataFrame, np.ndarray]:
    """The held-out sessions and their real outcome: final retention at or above the threshold."""
    config = RewardsConfig()
    sessions = session_records([e for e in held if e["type"] == "session.completed"])
    labels = build_labels(sessions, signal_records(held), config, now).sessions
    frame = sessions.set_index("session_id").join(labels)
    frame = frame[frame["retention"].notna() & frame["retention_final"].astype(bool)]
    y = (frame["retention"].to_numpy() >= config.positive_threshold).astype(int)
    return frame.reset_index(), y


def attacker_traffic(
    i: int, n_sessions: int, args: argparse.Namespace, span: float, now: datetime
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Sessions served to attacker ``i`` and the inverted signals it wants to send about them, in order."""
    sessions, truth = generate_events(
        n_sessions, seed=10_000 + i, start=START, span_s=span, now=START, users=1, group_fraction=0.0
    )
    sessions = [e for e in sessions if e["type"] == "session.completed"]
    user = f"attacker-{i}"
    utility = dict(zip(truth["session_id"], truth["utility"], strict=True))
    signals = []
    for e in sessions:
        e["user_id"] = user
        e["session_id"] = f"{user}-{e['session_id']}"
        at = datetime.fromisoformat(e["occurred_at"].replace("Z", "+00:00"))
        keep = utility[e["session_id"].removeprefix(f"{user}-")] < 0  # the opposite of what users do
        text = e["payload"]["segments"][-1]["text"]
        written = text.count("\n")
        for h in HORIZONS:
            payload = {
                "horizon_s": h,
                "lines_written": written,
                "lines_retained": written if keep else 0,
                "final_text": text if keep else "# rewritten by hand\n",
            }
            signals.append(_signal("code.retained", e["session_id"], user, at + timedelta(seconds=h), payload))
        kind = "edit.accepted" if keep else "edit.rejected"
        signals.append(
            _signal(kind, e["session_id"], user, at + timedelta(seconds=20), {"edit_id": f"x-{e['session_id']}"})
        )
    return sessions, signals


_seq = iter(range(10**12))


def _signal(kind: str, session: str, user: str | None, at: datetime, payload: dict[str, Any]) -> dict[str, Any]:
    env = {
        "schema_version": 1,
        "event_id": f"sig-{next(_seq)}",
        "type": kind,
        "session_id": session,
        "occurred_at": _ts(at),
        "payload": payload,
    }
    if user is not None:
        env["user_id"] = user
    return env


def through_gateway(
    gw: Gateway, clock: SimClock, client: ClientKey, signals: list[dict[str, Any]], window_s: float, rps: float | None
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Send ``signals`` in order through the gateway and return those it accepted, with the answers counted.

    With ``rps`` the sender tries one signal every ``1 / rps`` simulated seconds until the window closes,
    retrying a refused one at its next send; without it each signal is sent at its own ``occurred_at``.
    """
    accepted: list[dict[str, Any]] = []
    answers: dict[str, int] = {}
    k = 0
    t = 0.0
    while k < len(signals):
        if rps is not None:
            if t > window_s:
                break
            clock.now = t
            t += 1.0 / rps
        else:
            at = datetime.fromisoformat(signals[k]["occurred_at"].replace("Z", "+00:00"))
            clock.now = (at - START).total_seconds()
        raw = dict(signals[k])
        response = gw.signal(raw, client)
        answers[str(response.status_code)] = answers.get(str(response.status_code), 0) + 1
        if response.status_code == 202:
            accepted.append(raw)  # as forwarded: the gateway fills in the served user
            k += 1
        elif response.status_code != 429 or rps is None:
            k += 1  # refused for good (or a duplicate): the sender moves on
    return accepted, answers


def victim_attack(victim: str, attacker: str, now: datetime) -> list[dict[str, Any]]:
    """Rejections of the victim's session from an attacker: dated now, and in the year 2999."""
    out = []
    for when in (now, datetime(2999, 1, 1, tzinfo=UTC)):
        for h in HORIZONS:
            payload = {"horizon_s": h, "lines_written": 5, "lines_retained": 0, "final_text": "# rewritten\n"}
            out.append(_signal("code.retained", victim, attacker, when, payload))
            out.append(_signal("code.retained", victim, None, when, payload))
    return out


def retention_label(
    sessions: pd.DataFrame, signals: list[dict[str, Any]], session_id: str, now: datetime, config: RewardsConfig
) -> float:
    rows = sessions[sessions["session_id"] == session_id]
    mine = [s for s in signals if s.get("session_id") == session_id]
    labels = build_labels(rows, signal_records(mine), config, now).sessions
    return float(labels.loc[session_id, "retention"])


def auc_of(
    sessions: pd.DataFrame,
    signals: pd.DataFrame,
    config: RewardsConfig,
    now: datetime,
    held: pd.DataFrame,
    y: np.ndarray,
    seeds: int,
) -> tuple[float, list[float], float]:
    """Train from frames once per training seed; the mean AUC of the bundle on the clean held-out set,
    each seed's AUC, and the training seconds per seed. SGD's order alone moves the AUC of one run by
    about as much as the targets allow, so every figure is a mean over the same seeds."""
    values = []
    t0 = time.perf_counter()
    for seed in range(seeds):
        fit = fit_reward_models(sessions, signals, config.model_copy(update={"seed": seed}), now)
        value = ev.auc(y, fit.bundle.score(held))
        values.append(float(value if value is not None else float("nan")))
    return float(np.mean(values)), [round(v, 4) for v in values], (time.perf_counter() - t0) / seeds


def decide(
    honest: list[tuple[str, str, float]],
    attackers: int,
    values: list[float],
    defended: bool,
    args: argparse.Namespace,
) -> bool:
    """One canary decision: honest users' signals on v1 and v2, plus ``attackers`` accounts each sending
    ``values`` (accept 1.0, reject 0.0) about the canary (v2), through the gateway when ``defended``."""
    clock = SimClock()
    gw = make_gateway(clock)
    cfg = GatewayConfig() if defended else GatewayConfig(gate_signals_per_user=0)
    stats = {v: VersionStats(per_user_cap=cfg.gate_signals_per_user, trim=cfg.gate_trim_users) for v in ("v1", "v2")}
    for n, (user, version, value) in enumerate(honest):
        gw.trust.served(f"g-{user}-{version}-{n}", version, user, PLUGIN.name)
        stats[version].requests += 1
        stats[version].judge(user, value)
    for a in range(attackers):
        user = f"attacker-{a}"
        key = ClientKey(f"{user}-key", ("serve",), user)
        sid = f"g-{user}-canary"
        gw.trust.served(sid, "v2", user, key.name)
        signals = [
            {**_signal("edit.accepted" if v else "edit.rejected", sid, user, START, {}), "value": v} for v in values
        ]
        sent = (
            through_gateway(gw, clock, key, signals, args.gate_window_s, args.attacker_rps)[0] if defended else signals
        )
        for s in sent:
            stats["v2"].judge(user, float(s["value"]))
    return gate(stats["v2"].summary(), stats["v1"].summary(), DeployConfig())[0]


def gate_trials(args: argparse.Namespace, attackers: int) -> dict[str, Any]:
    """Canary decisions with and without attackers, defenses on and off, over ``--gate-trials`` draws.

    ``extreme``: every attacker signal says the same (all rejections, or all acceptances);
    ``adaptive``: one in ten says the opposite, so the attacker's own mean sits inside the honest
    users' range instead of at its edge, where trimming removes it.
    """
    rng = np.random.default_rng(args.seed + 7)
    sends = int(args.gate_window_s * args.attacker_rps)
    out: dict[str, Any] = {}
    for scenario, (p_old, p_new, goal) in {
        "good_canary_attacked_to_roll_back": (0.62, 0.64, 0.0),
        "bad_canary_attacked_to_pass": (0.62, 0.48, 1.0),
    }.items():
        trials = [
            [
                (f"dev-{u}", version, float(rng.random() < p))
                for u in range(args.gate_users)
                for version, p in (("v1", p_old), ("v2", p_new))
                for _s in range(int(rng.integers(1, 5)))
            ]
            for _ in range(args.gate_trials)
        ]
        result: dict[str, Any] = {}
        clean = [decide(h, 0, [], True, args) for h in trials]
        clean_off = [decide(h, 0, [], False, args) for h in trials]
        result["clean_pass_rate"] = round(sum(clean) / len(trials), 3)
        for style, values in {
            "extreme": [goal] * sends,
            "adaptive": [goal if i % 10 else 1.0 - goal for i in range(sends)],
        }.items():
            label = f"gate, {attackers} attacker(s), {scenario}, {style}"
            on = [decide(h, attackers, values, True, args) for h in tqdm(trials, desc=label, file=sys.stderr)]
            off = [decide(h, attackers, values, False, args) for h in trials]
            result[style] = {
                "flipped_defenses_on": round(sum(a != b for a, b in zip(on, clean, strict=True)) / len(trials), 3),
                "flipped_defenses_off": round(
                    sum(a != b for a, b in zip(off, clean_off, strict=True)) / len(trials), 3
                ),
            }
        out[scenario] = result
    return out


def attack(
    args: argparse.Namespace, base: dict[str, Any], attackers: int, held: pd.DataFrame, y: np.ndarray, clean_auc: float
) -> dict[str, Any]:
    """One attack (``attackers`` accounts), defenses on and off."""
    now, span = base["now"], base["span"]
    honest = base["events"]
    honest_sessions = [e for e in honest if e["type"] == "session.completed"]
    honest_signals = [e for e in honest if e["type"] != "session.completed"]
    per_attacker = int(span * args.attacker_rps) // 4 + 1
    clock = SimClock()
    gw = make_gateway(clock)
    for e in honest_sessions:
        gw.trust.served(e["session_id"], e["payload"]["policy_version"], e.get("user_id"), PLUGIN.name)

    # honest users through the gateway, each at the times they act: none may be refused
    by_user: dict[str | None, list[dict[str, Any]]] = {}
    for s in sorted(honest_signals, key=lambda s: s["occurred_at"]):
        by_user.setdefault(s.get("user_id"), []).append(s)
    honest_on: list[dict[str, Any]] = []
    honest_answers: dict[str, int] = {}
    for user_signals in by_user.values():
        accepted, answers = through_gateway(gw, clock, PLUGIN, user_signals, span, None)
        honest_on += accepted
        for k, v in answers.items():
            honest_answers[k] = honest_answers.get(k, 0) + v

    sessions_on, signals_on = list(honest_sessions), list(honest_on)
    sessions_off, signals_off = list(honest_sessions), list(honest_signals)
    attacker_answers: dict[str, int] = {}
    for i in tqdm(range(attackers), desc=f"{attackers} attacker(s)", file=sys.stderr):
        served, wanted = attacker_traffic(i, per_attacker, args, span, now)
        user = served[0]["user_id"]
        key = ClientKey(f"{user}-key", ("serve",), user)
        for e in served:
            gw.trust.served(e["session_id"], e["payload"]["policy_version"], user, key.name)
        accepted, answers = through_gateway(gw, clock, key, wanted, span, args.attacker_rps)
        for k, v in answers.items():
            attacker_answers[k] = attacker_answers.get(k, 0) + v
        labeled = {s["session_id"] for s in accepted}
        sessions_on += [e for e in served if e["session_id"] in labeled]
        signals_on += accepted
        sessions_off += served
        signals_off += wanted

    # the victim: an honest session that users kept
    frame = session_records(honest_sessions)
    clean_labels = build_labels(frame, signal_records(honest_signals), RewardsConfig(), now).sessions
    kept = clean_labels[clean_labels["retention"].fillna(0) >= 0.9].index
    victim = str(sorted(kept)[0])
    flood = victim_attack(victim, "attacker-0", now)
    refused = 0
    for s in flood:
        refused += gw.signal(dict(s), ClientKey("attacker-0-key", ("serve",), "attacker-0")).status_code >= 400
    off_config = RewardsConfig(max_user_share=1.0, require_session_user=False)
    victim_result = {
        "clean": round(retention_label(frame, honest_signals, victim, now, RewardsConfig()), 3),
        "defenses_on": round(retention_label(frame, signals_on, victim, now, RewardsConfig()), 3),
        "defenses_off": round(retention_label(frame, signals_off + flood, victim, now, off_config), 3),
        "attack_signals": len(flood),
        "refused_defenses_on": refused,
    }
    seeds = args.model_seeds
    auc_on, per_on, train_on = auc_of(
        session_records(sessions_on), signal_records(signals_on), RewardsConfig(), now, held, y, seeds
    )
    auc_off, per_off, train_off = auc_of(
        session_records(sessions_off), signal_records(signals_off), off_config, now, held, y, seeds
    )
    return {
        "attackers": attackers,
        "victim_label": victim_result,
        "auc_defenses_on": round(auc_on, 4),
        "auc_defenses_off": round(auc_off, 4),
        "auc_move_defenses_on": round(abs(auc_on - clean_auc), 4),
        "auc_move_defenses_off": round(abs(auc_off - clean_auc), 4),
        "auc_per_seed": {"on": per_on, "off": per_off},
        "attacker_signals_accepted_on": len(signals_on) - len(honest_on),
        "attacker_signals_sent_off": len(signals_off) - len(honest_signals),
        "attacker_answers_on": attacker_answers,
        "honest_answers_on": honest_answers,
        "train_s": {"on": round(train_on, 1), "off": round(train_off, 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=6000)
    parser.add_argument("--hours", type=float, default=6.0)
    parser.add_argument("--attacker-rps", type=float, default=3.0)
    parser.add_argument("--gate-trials", type=int, default=40)
    parser.add_argument("--gate-users", type=int, default=200)
    parser.add_argument("--gate-window-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-seeds", type=int, default=3, help="training seeds each AUC is averaged over")
    parser.add_argument("--quick", action="store_true", help="a small world (for a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (always; `make bench` passes it)")
    args = parser.parse_args()
    from scheduler.runtime.logs import configure_logging

    configure_logging("WARNING")  # stdout carries the one JSON object
    if args.quick:
        args.users, args.sessions, args.hours, args.gate_trials, args.model_seeds = 40, 1500, 1.0, 6, 1
    t0 = time.perf_counter()
    base = world(args)
    held, y = held_out_labels(base["held"], base["now"])
    honest = base["events"]
    clean_auc, clean_per_seed, clean_s = auc_of(
        session_records([e for e in honest if e["type"] == "session.completed"]),
        signal_records([e for e in honest if e["type"] != "session.completed"]),
        RewardsConfig(),
        base["now"],
        held,
        y,
        args.model_seeds,
    )
    five_percent = max(1, round(0.05 * args.users))
    result = {
        "conditions": {
            "honest_users": args.users,
            "honest_sessions": args.sessions,
            "window_hours": args.hours,
            "held_out": {"sessions": len(held), "users": int(held["user_id"].nunique()), "positives": int(y.sum())},
            "attacker_rps": args.attacker_rps,
            "gateway": GatewayConfig().model_dump(
                include={"user_signal_rate_per_s", "user_signal_burst", "gate_signals_per_user", "gate_trim_users"}
            ),
            "max_user_share": RewardsConfig().max_user_share,
            "gate": {
                "trials": args.gate_trials,
                "honest_users": args.gate_users,
                "window_s": args.gate_window_s,
                "max_acceptance_drop": DeployConfig().gate_max_acceptance_drop,
            },
            "seed": args.seed,
            "model_seeds": args.model_seeds,
            "auc_of": "the composite reward bundle's score against the held-out users' final retention >= 0.5",
        },
        "auc_clean": round(clean_auc, 4),
        "auc_clean_per_seed": clean_per_seed,
        "one_account": attack(args, base, 1, held, y, clean_auc),
        "five_percent": attack(args, base, five_percent, held, y, clean_auc),
        "gate_one_account": gate_trials(args, 1),
        "gate_five_percent": gate_trials(args, max(1, round(0.05 * args.gate_users))),
        "clean_train_s": round(clean_s, 1),
        "total_s": 0.0,
    }
    one, many = result["one_account"], result["five_percent"]
    gates = result["gate_one_account"]
    result["targets"] = {
        "one_account_flips_no_gate_decision": all(g["extreme"]["flipped_defenses_on"] == 0 for g in gates.values()),
        "one_account_auc_move_le_0_01": one["auc_move_defenses_on"] <= 0.01,
        "five_percent_auc_move_lt_0_03": many["auc_move_defenses_on"] < 0.03,
    }
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
